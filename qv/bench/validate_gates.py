"""The gates of `qv validate` (qv/bench/validate.py says what each checks and why those bounds)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qv.bench import validate_texts as texts
from qv.engine.request import SamplingParams
from qv.llm import LLM
from qv.version import __version__

GATES = ("reference", "retrieval", "retrieval_depth", "speculation", "clef", "repeatability", "speed")
# |delta log p| and the top-2 gap below which a top-1 difference is a tie, per qv activation dtype
# (docs/VALIDATION.md: the engine oracle's fp32 ceiling; the 16-bit end-to-end logit bounds)
REFERENCE_BOUNDS = {"torch.float32": 1e-3, "torch.bfloat16": 5e-2, "torch.float16": 2e-2}
CLEF_BOUND = 0.0093  # the original Clef's published max |delta p| in fp16
CLEF_ROUNDING = 1e-4 + 1e-9  # answers carry 4 decimals: a batch and a record alone may round apart by one unit


@dataclass
class GateResult:
    gate: str
    status: str  # pass | fail | skip | info
    measured: str = ""
    bound: str = ""
    detail: str = ""
    values: dict = field(default_factory=dict)


@dataclass
class ValidateOptions:
    gates: tuple[str, ...] = GATES
    retrieval_tokens: int = 0  # 0: the longest prompt the memory plan holds, at most 243,173
    code_word: str | None = None  # None: five seeded digits
    min_acceptance: float = 3.6
    spec_k: int = 3
    new_tokens: int = 16  # greedy tokens per reference prompt
    passage_tokens: int = 64  # greedy tokens per passage (speculation)
    speed_prefill: int = 8192
    seed: int = 0
    levers: dict = field(default_factory=dict)


def clef_reference_available(model_dir: str) -> str | None:
    """Why Cloudflare's reference cannot run on this folder, or None when it can."""
    if importlib.util.find_spec("clef_finetune") is None:
        return "clef-finetune is not installed (pip install --no-deps clef-finetune)"
    if not (Path(model_dir) / "joint_head.safetensors").is_file():
        return "the folder is not a Clef release (joint_head.safetensors beside the weights): merge its adapters first"
    return None


def _greedy(max_tokens: int, logprobs: int | None = 0) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)


def _bits(outputs) -> list:
    """Everything a request returns that must repeat: token ids and every logprob, exactly."""
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs or []])
            for o in outputs]


class EngineRun:
    """qv with speculation off: the gates that need only it, and what the oracles compare later."""

    def __init__(self, model_dir: str, opts: ValidateOptions, log):
        self.opts, self.log = opts, log
        self.llm = LLM(model=model_dir, **{**opts.levers, "spec": "off"})
        self.tok = self.llm.tokenizer
        self.observed: dict = {"dtype": str(self.llm.engine.runner.model.dtype)}

    def header(self) -> dict:
        e = self.llm.engine
        model = e.runner.model
        return {"model": str(self.llm.config.model), "version": __version__, "device": str(model.device),
                "dtype": self.observed["dtype"], "cuda_graphs": e.runner.graphs is not None,
                "memory_plan": e.memory_plan.summary() if getattr(e, "memory_plan", None) else None}

    def gates(self) -> dict[str, GateResult]:
        out = {}
        gates = self.opts.gates
        if "reference" in gates:
            self._reference_side()
        if "speculation" in gates:
            prompts = [{"prompt_token_ids": self.tok.encode(p, add_special_tokens=False)} for p in texts.PASSAGES]
            self.observed["passages"] = prompts
            self.observed["passages_off"] = [o.outputs[0].token_ids for o in
                                             self.llm.generate(prompts, _greedy(self.opts.passage_tokens, None))]
        if "clef" in gates and self.llm.engine.clef is not None:
            self.observed["clef"] = [self.llm.decide(list(texts.CLEF_RECORDS)), self.llm.decide(list(texts.CLEF_RECORDS)),
                                     [self.llm.decide(r) for r in texts.CLEF_RECORDS]]
        if "retrieval" in gates or "retrieval_depth" in gates:
            out.update(self._retrieval())
        if "repeatability" in gates:
            out["repeatability"] = self._repeatability()
        return out

    def _reference_side(self):
        prompts = [{"prompt_token_ids": self.tok.encode(p, add_special_tokens=False)} for p in texts.REFERENCE_PROMPTS]
        mm = self.llm.engine.multimodal
        image = None
        if mm is not None:  # one image prompt: its pixels and grid go to transformers as qv preprocessed them
            ids = self.tok.encode(texts.IMAGE_PROMPT, add_special_tokens=False)
            image = mm.from_data(ids, [texts.sample_image(self.opts.seed)])
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": texts.sample_image(self.opts.seed)}})
        outs = self.llm.generate(prompts, _greedy(self.opts.new_tokens))
        self.observed["reference"] = [(o.prompt_token_ids, o.outputs[0].token_ids,
                                       [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                                      for o in outs]
        if image is not None:
            self.observed["reference_image"] = {
                "pixel_values": torch.cat([it.pixel_values for it in image.items]).cpu(),
                "image_grid_thw": [list(it.grid_thw) for it in image.items],
                "image_token_id": self.llm.engine.model_config.image_token_id}

    def retrieval_tokens(self) -> int:
        if self.opts.retrieval_tokens:
            return self.opts.retrieval_tokens
        plan = getattr(self.llm.engine, "memory_plan", None)
        longest = plan.longest_context if plan is not None else self.llm.engine.max_model_len
        return min(texts.MAX_RETRIEVAL_TOKENS, longest - 16)  # room for the answer

    def _answer(self, probes: list[texts.Probe]) -> list[tuple[texts.Probe, str]]:
        params = [_greedy(len(self.tok.encode(p.expected, add_special_tokens=False)) + 4, None) for p in probes]
        outs = self.llm.generate([{"prompt_token_ids": p.prompt_ids} for p in probes], params)
        return [(p, o.outputs[0].text) for p, o in zip(probes, outs)]

    def _retrieval(self) -> dict[str, GateResult]:
        n, out = self.retrieval_tokens(), {}
        if "retrieval" in self.opts.gates:
            word = self.opts.code_word or texts.code_word(self.opts.seed)
            self.log(f"qv validate: retrieval: a code word before {n:,} tokens")
            ((probe, said),) = self._answer([texts.code_word_probe(self.tok, n, word)])
            ok = probe.expected in said
            out["retrieval"] = GateResult("retrieval", "pass" if ok else "fail", f"answered {said.strip()[:40]!r}",
                                          f"{probe.expected!r} verbatim", f"{len(probe.prompt_ids):,}-token prompt",
                                          {"tokens": len(probe.prompt_ids), "expected": probe.expected, "answer": said})
        if "retrieval_depth" in self.opts.gates:
            self.log(f"qv validate: retrieval_depth: facts at 5/50/95% of {n:,} tokens")
            answered = self._answer(texts.fact_probes(self.tok, n, self.opts.seed))
            missed = [p.name for p, said in answered if p.expected not in said]
            out["retrieval_depth"] = GateResult(
                "retrieval_depth", "fail" if missed else "pass", f"{len(answered) - len(missed)}/{len(answered)} facts",
                "3/3 verbatim", "missed: " + ", ".join(missed) if missed else f"{len(answered[0][0].prompt_ids):,}-token prompts",
                {"answers": {p.name: [p.expected, said] for p, said in answered}})
        return out

    def _repeatability(self) -> GateResult:
        prompts = [{"prompt_token_ids": self.tok.encode(p, add_special_tokens=False)} for p in texts.REFERENCE_PROMPTS]
        greedy = _greedy(self.opts.new_tokens, 5)
        sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=self.opts.seed + 11, max_tokens=self.opts.new_tokens,
                                 logprobs=5, ignore_eos=True)
        runs = [_bits(self.llm.generate(prompts, p)) for p in (greedy, sampled, greedy, sampled)]
        same = runs[0] == runs[2] and runs[1] == runs[3]
        return GateResult("repeatability", "pass" if same else "fail", "identical" if same else "differs",
                          "same bits", f"{len(prompts)} prompts, greedy and seeded sampling, top-5 logprobs")


def _hf_model(model_dir: str, dtype: torch.dtype, device: torch.device):
    import transformers

    arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(model_dir, dtype=dtype).to(device).eval()


def _oracle_dtype(qv_dtype: str, device: torch.device) -> torch.dtype:
    """float64 where qv runs fp32 on the CPU (the model oracle's choice); qv's own dtype on a GPU."""
    if qv_dtype == "torch.float32":
        return torch.float64 if device.type == "cpu" else torch.float32
    return getattr(torch, qv_dtype.removeprefix("torch."))


def _image_inputs(observed: dict, ids: torch.Tensor, dtype: torch.dtype) -> dict:
    """transformers' image inputs for a prompt holding image pads (none for a text prompt)."""
    image = observed.get("reference_image")
    if image is None or not bool((ids == image["image_token_id"]).any()):
        return {}
    return {"pixel_values": image["pixel_values"].to(ids.device, dtype),
            "image_grid_thw": torch.tensor(image["image_grid_thw"], device=ids.device),
            "mm_token_type_ids": (ids == image["image_token_id"]).int()}


def reference_gate(model_dir: str, observed: dict) -> GateResult:
    qv_dtype = observed["dtype"]
    bound = REFERENCE_BOUNDS.get(qv_dtype)
    if bound is None:
        return GateResult("reference", "skip", detail=f"no published bound for activations in {qv_dtype}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = _hf_model(model_dir, _oracle_dtype(qv_dtype, device), device)
    except Exception as exc:  # noqa: BLE001 - e.g. GPTQ without transformers' GPTQ backend: say why
        return GateResult("reference", "skip", detail=f"transformers cannot load this folder: {exc}"[:300])
    worst, agree, total, ties = 0.0, 0, 0, 0
    with torch.no_grad():
        for prompt, tokens, logprobs in observed["reference"]:
            ids = torch.tensor([prompt + tokens], device=device)
            logp = model(input_ids=ids, **_image_inputs(observed, ids, model.dtype)).logits[0].double().log_softmax(-1)
            logp = logp[len(prompt) - 1: -1]
            for row, token, lp in zip(logp, tokens, logprobs):
                worst = max(worst, abs(row[token].item() - lp))
                top2 = row.topk(2).values
                if int(row.argmax()) == token:
                    agree += 1
                elif (top2[0] - top2[1]).item() < bound:
                    ties += 1  # a near tie: either token is right
                total += 1
    ok = worst <= bound and agree + ties == total
    return GateResult("reference", "pass" if ok else "fail", f"max |dlogp| {worst:.2e}, top-1 {agree}/{total}"
                      + (f" (+{ties} near ties)" if ties else ""), f"|dlogp| <= {bound:g} ({qv_dtype}), top-1 all",
                      f"{len(observed['reference'])} prompts{' (one with an image)' if 'reference_image' in observed else ''}"
                      f" vs transformers {model.dtype}",
                      {"max_abs_dlogp": worst, "top1_agree": agree, "near_ties": ties, "tokens": total})


def _max_dp(a: list[dict], b: list[dict]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        for qid, ans in x["answers"].items():
            other = y["answers"][qid]
            if ans["type"] == "noul":
                worst = max(worst, abs(ans["noul"] - other["noul"]))
            else:
                worst = max(worst, max(abs(p - other["probabilities"][k]) for k, p in ans["probabilities"].items()))
    return worst


def _clef_reference(model_dir: str, qv_dtype: str) -> list[dict]:
    import types

    from clef_finetune.jsm import load_jsm
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    jsm, folder = load_jsm(), Path(model_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if qv_dtype == "torch.float32" else torch.float16  # the original's bound is for fp16
    backbone = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
    head = jsm.JointSchemaHead(**json.loads((folder / "joint_head_config.json").read_text()))
    head.load_state_dict(load_file(str(folder / "joint_head.safetensors")), strict=True)
    model = jsm.ClefModel(backbone, head.float().to(device)).eval()
    processor = types.SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(folder))
    with torch.no_grad():
        return [jsm.systemone(model, processor, dict(r)) for r in texts.CLEF_RECORDS]


def clef_gate(model_dir: str, observed: dict, log) -> GateResult:
    if "clef" not in observed:
        return GateResult("clef", "skip", detail="the folder has no Clef head (or clef=0)")
    batched, again, alone = observed["clef"]
    spread = _max_dp(batched, alone)
    consistent = batched == again and spread <= CLEF_ROUNDING
    why_not = clef_reference_available(model_dir)
    values = {"batch_vs_alone": spread, "repeat_identical": batched == again}
    if why_not is not None:
        return GateResult("clef", "pass" if consistent else "fail", f"self-consistency: batch vs alone {spread:.1e}",
                          f"<= {CLEF_ROUNDING:.0e}, repeat identical", f"no reference: {why_not}", values)
    log("qv validate: clef: Cloudflare's systemone() on the same folder")
    reference = _clef_reference(model_dir, observed["dtype"])
    worst = _max_dp(batched, reference)
    ok = consistent and worst <= CLEF_BOUND
    return GateResult("clef", "pass" if ok else "fail", f"max |dp| {worst:.2e} vs Clef; batch vs alone {spread:.1e}",
                      f"<= {CLEF_BOUND} (the original's)", f"{len(texts.CLEF_RECORDS)} records, clef-finetune systemone()",
                      {**values, "max_abs_dp": worst})


def speculation_gate(model_dir: str, opts: ValidateOptions, observed: dict) -> GateResult:
    from qv.model_config import ModelConfig

    if ModelConfig.from_dir(model_dir).mtp_num_hidden_layers == 0:
        return GateResult("speculation", "skip", detail="the checkpoint has no MTP head (mtp_num_hidden_layers 0)")
    llm = LLM(model=model_dir, **{**opts.levers, "spec": "mtp", "spec_k": opts.spec_k, "spec_policy": "always"})
    outs = llm.generate(observed["passages"], _greedy(opts.passage_tokens, None))
    stats = llm.engine.stats
    acceptance = 1 + stats.spec_num_accepted_tokens / max(1, stats.spec_num_drafts)
    same = [o.outputs[0].token_ids for o in outs] == observed["passages_off"]
    ok = same and acceptance >= opts.min_acceptance
    detail = "greedy equal to speculation off" if same else "greedy DIFFERS from speculation off"
    return GateResult("speculation", "pass" if ok else "fail", f"acceptance {acceptance:.2f} tokens/step",
                      f">= {opts.min_acceptance:g} at k = {opts.spec_k}; greedy equal", detail,
                      {"acceptance_length": acceptance, "drafts": stats.spec_num_drafts, "greedy_equal": same})


def speed_gate(model_dir: str, opts: ValidateOptions) -> GateResult:
    from qv.bench import BenchSpec, run_bench
    from qv.bench.presets import bench_config

    spec = BenchSpec(batch_sizes=(1,), batch_context=1024, contexts=(), prefill_lengths=(opts.speed_prefill,),
                     steps=16, warmup=2)
    report = run_bench(bench_config(dict(opts.levers), model_dir, None, spec.longest, 1), spec, model_dir)
    rows = {r["kind"]: r for r in report["rows"]}
    decode, prefill = rows["decode"], rows["prefill"]
    measured = (f"decode b1 {1e3 * decode['measured_s']:.2f} ms/step (floor {1e3 * decode['floor_s']:.2f}); "
                f"prefill {prefill['tokens']:,} tok {prefill['measured_s']:.2f} s (floor {prefill['floor_s']:.2f})")
    return GateResult("speed", "info", measured, "reported beside the floor",
                      f"floor/measured {decode['floor_ratio']:.2f} decode, {prefill['floor_ratio']:.2f} prefill",
                      {"rows": [decode, prefill]})
