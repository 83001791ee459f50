"""Served LoRA adapters (vLLM's --enable-lora): PEFT adapter folders held in host memory, paged into
the device slots every Linear's DeltaBank reserves (qv/model/delta_bank.py: slot 0 is Clef's, slots
1..max_loras the adapters'), and the step's delta rows grouped by slot, so that rows of several
adapters, Clef records and plain chats share one step and one grouped launch per Linear.

- registering: `load(name, path)` reads and checks the folder (modules qv places, shapes against the
  weights, rank against max_lora_rank) before anything is kept; `unload(name)` refuses while requests
  run on it. Both may be called off the engine thread (one lock).
- a request: `resolve(name)` for the engine's add_request; its sequences are `assign`ed, and the prefix
  cache key is salted with the adapter's load id (`salt`), so no two adapters (or two loads of one
  name) share KV blocks or GDN snapshots.
- a step (StepFeature.fit_plan): every scheduled sequence's adapter is made resident, evicting the
  least recently used adapter no scheduled sequence needs; a step holds rows of at most max_loras
  adapters, the sequences of the others wait for a later step.
- the step's inputs (StepFeature.fill_inputs): every delta row grouped by slot (Clef's records in slot 0)
  into the `delta_rows` field and all max_loras + 2 slot starts into `delta_slot_start`
  (qv/engine/step_inputs.py), every step: a replayed decode graph reads every slot's start.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qv.clef.adapters import ClefLayoutError, all_linears, place_modules, read_peft_adapter
from qv.engine.sequence import Sequence
from qv.engine.step_feature import StepFeature
from qv.errors import ConfigError, LoraError
from qv.model.delta_bank import DeltaBank

log = logging.getLogger("qv")


@dataclass
class LoraAdapter:
    name: str
    path: str
    uid: int  # this load's id: part of the prefix-cache salt
    rank: int
    pieces: dict  # Linear -> [(member, A, B, scale)] in host memory (pinned beside a GPU)
    nbytes: int


def parse_lora_modules(value: str) -> dict[str, str]:
    """The lora_modules lever: name=path entries (space/comma separated) or a JSON list of entries or of
    {"name", "path"} objects (vLLM's --lora-modules); {name: path}."""
    import json

    value = value.strip()
    if not value:
        return {}
    items = json.loads(value) if value.startswith("[") else value.replace(",", " ").split()
    out = {}
    for item in items:
        if isinstance(item, str) and item.strip().startswith("{"):
            item = json.loads(item)
        if isinstance(item, dict):
            name, path = item.get("name"), item.get("path")
        elif isinstance(item, str) and "=" in item:
            name, path = item.split("=", 1)
        else:
            name = path = None
        if not name or not path:
            raise ConfigError(f"lora_modules: {item!r} is not name=path or {{\"name\": ..., \"path\": ...}}")
        out[name] = path
    return out


def reserve_lora_slots(model, max_loras: int, max_lora_rank: int) -> int:
    """Give every Linear an adapter can target `max_loras` slots of rank `max_lora_rank` on each of its
    members (after Clef's slot 0, empty where Clef has no delta); returns the bytes they add."""
    added = 0
    for linear in all_linears(model):
        if linear.bank is None:
            linear.bank = DeltaBank(linear.weight.shape[1], linear.member_sizes, [0], [0], model.dtype, model.device)
        before = linear.bank.nbytes
        members, n = len(linear.member_sizes), sum(linear.member_sizes)
        linear.bank.grow([max_lora_rank * members] * max_loras, [max_lora_rank * n] * max_loras)
        added += linear.bank.nbytes - before
    return added


class LoraRows(StepFeature):
    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int = 0, clef=None):
        """clef: the engine's ClefRows, whose records' delta rows go into slot 0 of the step's groups."""
        self.model, self.max_loras, self.max_lora_rank = model, max_loras, max_lora_rank
        self.clef = clef
        if clef is not None:
            clef.rows_grouped = True
        self.max_cpu_loras = max_cpu_loras
        self.linears = all_linears(model)
        self.adapters: dict[str, LoraAdapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> bank slot, least recently used first
        self.slot_uid: dict[int, int] = {}  # bank slot -> uid of the adapter written there
        self.seq_adapter: dict[Sequence, LoraAdapter] = {}
        self.lock = threading.Lock()
        self._uids = 0
        self.num_swaps = 0  # adapters written into a device slot
        self.log: list | None = None  # under tensor parallelism: slot writes the workers replay (start_log)
        self._read_by_uid: dict[int, LoraAdapter] = {}  # a worker's adapters, read on their first write

    # -- adapters ------------------------------------------------------------------------------
    def read(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter folder (nothing registered); LoraError naming the cause."""
        where = f"LoRA adapter {name!r} ({path})"
        if not Path(path).is_dir():
            raise LoraError(f"{where}: no such folder")
        try:
            modules = read_peft_adapter(path)
            too_big = [m for m in modules if m.a.shape[0] > self.max_lora_rank]
            if too_big:
                raise LoraError(f"{where}: rank {too_big[0].a.shape[0]} ({too_big[0].name}) is above max_lora_rank "
                                f"{self.max_lora_rank}")
            placed = place_modules(self.model, modules)
        except ClefLayoutError as exc:
            raise LoraError(f"{where}: {str(exc).replace('Clef deltas', 'adapters')}") from None
        pin = self.model.device.type == "cuda"
        pieces, nbytes = {}, 0
        for linear, ps in placed.items():
            out = []
            for m, a, b, scale in ps:
                a, b = a.to(self.model.dtype).contiguous(), b.to(self.model.dtype).contiguous()
                if pin:
                    a, b = a.pin_memory(), b.pin_memory()
                nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
                out.append((m, a, b, scale))
            pieces[linear] = out
        return LoraAdapter(name, str(path), 0, max(m.a.shape[0] for m in modules), pieces, nbytes)

    def load(self, name: str, path: str, base_names: tuple[str, ...] = ()) -> LoraAdapter:
        if not name or name in base_names:
            raise LoraError(f"LoRA adapter name {name!r} is empty or the base model's own name")
        with self.lock:
            if name in self.adapters:
                raise LoraError(f"LoRA adapter {name!r} is already loaded; unload it first")
            if self.max_cpu_loras and len(self.adapters) >= self.max_cpu_loras:
                raise LoraError(f"{len(self.adapters)} LoRA adapters are loaded, the most max_cpu_loras allows")
        adapter = self.read(name, path)  # off the lock: the slow part
        with self.lock:
            if name in self.adapters:
                raise LoraError(f"LoRA adapter {name!r} is already loaded; unload it first")
            self._uids += 1
            adapter.uid = self._uids
            self.adapters[name] = adapter
        log.info("LoRA adapter %s loaded from %s: rank %d, %d Linears, %.1f MiB in host memory", name, path,
                 adapter.rank, len(adapter.pieces), adapter.nbytes / 2**20)
        return adapter

    def unload(self, name: str) -> None:
        with self.lock:
            adapter = self.adapters.get(name)
            if adapter is None:
                raise LoraError(f"LoRA adapter {name!r} is not loaded", status=404)
            users = sum(1 for s, a in self.seq_adapter.items() if a is adapter and not s.finished)
            if users:
                raise LoraError(f"LoRA adapter {name!r} is in use by {users} running sequences; unload it when "
                                "they finish")
            del self.adapters[name]
            self.resident.pop(name, None)  # its slot is free; a later adapter overwrites it
        log.info("LoRA adapter %s unloaded", name)

    def names(self) -> list[tuple[str, str]]:
        with self.lock:
            return [(a.name, a.path) for a in self.adapters.values()]

    # -- requests ------------------------------------------------------------------------------
    def resolve(self, name: str) -> LoraAdapter:
        with self.lock:
            adapter = self.adapters.get(name)
        if adapter is None:
            raise LoraError(f"The model `{name}` does not exist.", status=404)
        return adapter

    @staticmethod
    def salt(adapter: LoraAdapter, cache_salt: str | None) -> str:
        """The prefix-cache salt of a request on this adapter (its own salt kept inside)."""
        return f"lora:{adapter.uid}:{cache_salt or ''}"

    def assign(self, seq: Sequence, adapter: LoraAdapter) -> None:
        self.seq_adapter[seq] = adapter

    # -- StepFeature ---------------------------------------------------------------------------
    def before_plan(self, scheduler) -> list[str]:
        with self.lock:
            for seq in [s for s in self.seq_adapter if s.finished]:
                del self.seq_adapter[seq]
        return []

    def fit_plan(self, plan) -> None:
        """Make the step's adapters resident; a sequence whose adapter finds no free slot leaves this step."""
        with self.lock:
            wanted: list[str] = []
            for seq, _ in plan.scheduled:
                a = self.seq_adapter.get(seq)
                if a is not None and a.name not in wanted and len(wanted) < self.max_loras:
                    wanted.append(a.name)
            for name in wanted:
                self._make_resident(name, wanted)
            plan.scheduled[:] = [(s, n) for s, n in plan.scheduled
                                 if s not in self.seq_adapter or self.seq_adapter[s].name in self.resident
                                 and self.seq_adapter[s].name in wanted]

    def _make_resident(self, name: str, wanted: list[str]) -> None:
        adapter = self.adapters[name]
        if name in self.resident:
            self.resident.move_to_end(name)
            return
        used = set(self.resident.values())
        free = [s for s in range(1, self.max_loras + 1) if s not in used]
        if not free:
            victim = next(n for n in self.resident if n not in wanted)  # exists: len(wanted) <= max_loras
            free = [self.resident.pop(victim)]
        slot = free[0]
        self.write_slot(slot, adapter)
        self.resident[name] = slot
        self.slot_uid[slot] = adapter.uid
        self.num_swaps += 1
        if self.log is not None:
            self.log.append((slot, adapter.path, adapter.uid))

    def write_slot(self, slot: int, adapter: LoraAdapter) -> None:
        for linear in self.linears:  # stream-ordered: steps launched before still read the old contents
            linear.bank.write(slot, adapter.pieces.get(linear, []))

    # -- tensor parallelism: every rank writes its cut of an adapter into the same slot --------------
    def start_log(self) -> None:
        self.log = []

    def take_log(self) -> tuple:
        ops, self.log = tuple(self.log), []
        return ops

    def replay(self, ops: tuple) -> None:
        """A worker: the driver's slot writes (slot, folder, load id), each adapter read (this rank's cut) once."""
        for slot, path, uid in ops:
            adapter = self._read_by_uid.get(uid)
            if adapter is None:
                adapter = self._read_by_uid[uid] = self.read(f"load {uid}", path)
            self.write_slot(slot, adapter)

    # -- the step's inputs ----------------------------------------------------------------------
    def fill_inputs(self, seqs: list[Sequence], cu: np.ndarray, host: dict) -> dict[str, int]:
        """Every delta row of the step grouped by bank slot (slot 0: Clef's records, s: the adapter resident
        there) into `delta_rows`, and the max_loras + 2 starts of the slots' groups into `delta_slot_start`,
        written every step (a step without delta rows leaves every slot empty)."""
        num_slots = self.max_loras + 1
        slot_of = np.full(len(seqs), -1, dtype=np.int64)
        with self.lock:
            for i, s in enumerate(seqs):
                a = self.seq_adapter.get(s)
                if a is not None:
                    slot_of[i] = self.resident[a.name]
        clef = self.clef
        if clef is not None and clef.has_deltas:
            for i, s in enumerate(seqs):
                if clef.owns(s):
                    slot_of[i] = 0
        starts = host["delta_slot_start"][:num_slots + 1]
        grouped = slot_of >= 0
        if not grouped.any():
            starts[:] = 0
            return {"delta_rows": 0, "delta_slot_start": num_slots + 1}
        lens = np.diff(cu[:len(seqs) + 1]).astype(np.int64)
        starts[0] = 0
        np.cumsum(np.bincount(slot_of[grouped], weights=lens[grouped], minlength=num_slots).astype(np.int64),
                  out=starts[1:])
        order = np.argsort(slot_of, kind="stable")
        order = order[slot_of[order] >= 0]
        rows = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in order])
        host["delta_rows"][:rows.size] = rows
        return {"delta_rows": int(rows.size), "delta_slot_start": num_slots + 1}


def make_lora_rows(cfg, model, clef=None) -> LoraRows | None:
    """LoraRows for enable_lora (slots reserved before the memory plan by reserve_lora_slots), with the
    adapters of lora_modules loaded; a bad one stops the start with its reason. clef: the engine's ClefRows."""
    if not cfg.enable_lora:
        if cfg.lora_modules:
            raise ConfigError("lora_modules is set but enable_lora is off")
        return None
    lora = LoraRows(model, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras, clef)
    for name, path in parse_lora_modules(cfg.lora_modules).items():
        try:
            lora.load(name, path)
        except LoraError as exc:
            raise ConfigError(f"lora_modules: {exc}") from None
    return lora


def check_lora_levers(cfg) -> None:
    """LoRA with levers it does not run under yet, refused by name at start."""
    if not cfg.enable_lora:
        return
    if cfg.clef_delta_host:
        raise ConfigError("enable_lora with clef_delta_host is not supported: the adapters' slots share the Clef "
                          "deltas' device bank")
