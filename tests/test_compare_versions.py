"""tools/compare_versions.py: how a row of several versions is judged and printed. CPU only."""
import importlib.util
import types
from pathlib import Path

from cupy_moe.configs import GemmConfig

_PATH = Path(__file__).resolve().parents[1] / "tools" / "compare_versions.py"
_spec = importlib.util.spec_from_file_location("compare_versions", _PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def _row(**checksums):
    row = dict(model="Mixtral-8x7B", phase="gate_up", m=256, this_config="32/1/tc", other_config="32/1/tc",
               other2_config="48/1/swapped", this_us=100.0, other_us=110.0, other2_us=80.0)
    row.update({f"{v}_checksum": c for v, c in checksums.items()})
    return row


def test_identical_needs_every_version():
    assert tool.identical(_row(this="a", other="a", other2="a"))
    assert not tool.identical(_row(this="a", other="a", other2="b"))
    assert not tool.identical(_row(this="a", other="b", other2="a"))


def test_report_adds_a_column_per_further_version(capsys):
    tool.report(_row(this="a", other="a", other2="b"))
    line = capsys.readouterr().out
    assert "DIFFERENT" in line
    assert " 0.909 " in line  # this / other
    assert line.rstrip().endswith("other2 48/1/swapped 80.0 1.250")


def test_config_label_tells_apart_every_tuned_entry():
    """accept_tuned.py keeps a raced entry only where the two labels differ: warps along K must show."""
    plain = GemmConfig.from_spec("reg:1,1,4,1,4,2,1/2")
    along_k = GemmConfig.from_spec("reg:1,1,4,1,4,2,4/2")
    assert (tool.config_label(plain), tool.config_label(along_k)) == ("16/2/reg", "16k/2/reg")
    assert tool.config_label(GemmConfig.from_spec("swapped:3,1,8,2,2,6,1")) == "48/1/swapped"
    before_warps_k = types.SimpleNamespace(block_m=64, split_k=1, kind="tc")  # an older checkout's config
    assert tool.config_label(before_warps_k) == "64/1/tc"
