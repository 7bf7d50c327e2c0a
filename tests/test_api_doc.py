"""docs/api.md's signatures are the code's: every entry that opens a line as `cupy_moe.name(params)` lists the
parameters, their order, keyword-only marker and defaults exactly (an entry ending in "..." lists a prefix)."""
import importlib
import inspect
import re
from pathlib import Path

import pytest

API = Path(__file__).resolve().parent.parent / "docs" / "api.md"
ENTRY = re.compile(r"^`(cupy_moe(?:\.[A-Za-z_]+)+)\(([^`]*?)\)(?: -> [^`]*)?`", re.M)
ENTRIES = ENTRY.findall(API.read_text())


def _params(fn) -> list[str]:
    out, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return out


def test_the_doc_has_entries():
    assert len(ENTRIES) >= 10


@pytest.mark.parametrize("name,documented", ENTRIES, ids=[name for name, _ in ENTRIES])
def test_documented_signature_is_the_code(name, documented):
    module, _, attr = name.rpartition(".")
    code = _params(getattr(importlib.import_module(module), attr))
    doc = [p.strip().replace('"', "'") for p in documented.split(",")]
    compared = code
    if doc[-1] == "...":
        doc, compared = doc[:-1], code[:len(doc) - 1]
    assert doc == compared, f"docs/api.md: {name}({documented}); the code: ({', '.join(code)})"
