"""A grammar-compile worker process (qv/engine/structured.py's CompileWorkers start it by path, so it
imports nothing of qv). xgrammar compiles in C++ and cannot be interrupted from Python: running it
here lets the engine abandon a compile over its budget, or whose client left, by killing the process.

Messages on stdin and stdout are a 4-byte big-endian length, then that many bytes of JSON. The
first message is {"info": TokenizerInfo.serialize_json()}, answered {"ready": true}; each later {"kind", "spec"} is answered
{"ok": CompiledGrammar.serialize_json()} or {"error": xgrammar's message}.
"""

import json
import struct
import sys

HEADER = struct.Struct(">I")


def read_message(stream):
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    body = stream.read(n)
    if len(body) < n:
        return None
    return json.loads(body)


def write_message(stream, obj) -> None:
    body = json.dumps(obj).encode()
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def compile_one(compiler, kind: str, spec: str):
    if kind == "json":
        return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
    if kind == "json_object":  # any object, compact (xgrammar's builtin JSON grammar allows free whitespace)
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(spec)
    return compiler.compile_grammar(spec)  # grammar, and choice (as EBNF)


def main() -> None:
    import xgrammar as xgr

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    init = read_message(stdin)
    if init is None:
        return
    info = xgr.TokenizerInfo.deserialize_json(init["info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_message(stdout, {"ready": True})
    while True:
        job = read_message(stdin)
        if job is None:
            return
        try:
            reply = {"ok": compile_one(compiler, job["kind"], job["spec"]).serialize_json()}
        except (ValueError, RuntimeError, TypeError) as exc:  # xgrammar reports bad input as these
            reply = {"error": str(exc)}
        write_message(stdout, reply)


if __name__ == "__main__":
    main()
