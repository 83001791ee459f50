"""A tiny checkpoint for speculation tests: preset "spec" (greedy output mostly walks cycles of 8
token ids, so it repeats lists and n-gram drafts can be right) with its MTP head self-distilled on
the target's own greedy continuations (qv.spec.fit)."""

from __future__ import annotations

import pytest

from qv.model.tiny import make_tiny
from qv.spec.fit import fit_mtp_head


@pytest.fixture(scope="session")
def fitted_dir(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("fitted") / "tiny-spec", "spec", seed=3, mtp=True)
    fit_mtp_head(path, steps=300, log=lambda *_: None)
    return str(path)
