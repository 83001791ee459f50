"""A tiny checkpoint fitted for speculation: the target trained to continue repeated lists (so
n-gram drafts can be right) and its MTP head self-distilled on the target's own greedy output."""

from __future__ import annotations

import pytest

from qv.model.tiny import make_tiny
from qv.spec.fit import fit_copy_model, fit_mtp_head


@pytest.fixture(scope="session")
def fitted_dir(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("fitted") / "tiny-mtp", "tiny", seed=3, mtp=True)
    fit_copy_model(path, steps=300, log=lambda *_: None)
    fit_mtp_head(path, steps=300, log=lambda *_: None)
    return str(path)
