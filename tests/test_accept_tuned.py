"""tools/accept_tuned.py: which tuned entries a same-run race lets into a shipped table. CPU only."""
import importlib.util
import json
from pathlib import Path

from cupy_moe import configs
from cupy_moe.models import get_model

_PATH = Path(__file__).resolve().parents[1] / "tools" / "accept_tuned.py"
_spec = importlib.util.spec_from_file_location("accept_tuned", _PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def _key(model, phase, m):
    shape = get_model(model)
    k, n, _ = shape.phases()[phase]
    return configs.tuning_key(shape.num_experts, k, n, 4, 128, m * shape.top_k)


def _row(model, phase, m, this_config, other_config, this_us, other_us):
    return dict(model=model, phase=phase, m=m, this_config=this_config, other_config=other_config, this_us=this_us,
                other_us=other_us, this_checksum="a", other_checksum="b")


def test_accept_keeps_only_changed_configurations_that_won(tmp_path, capsys):
    entry = lambda block_m, split: {"block_m": block_m, "split_k": split, "warps_k": 1, "time_us": 1.0}
    won, same, lost, noise = (_key("Mixtral-8x22B", "down", 256), _key("Mixtral-8x7B", "gate_up", 512),
                              _key("Qwen3-30B-A3B", "down", 1024), _key("DeepSeek-V3", "gate_up", 256))
    shipped = {"gpu": "NVIDIA H200", "entries": {won: entry(128, 1), lost: entry(128, 1), "E1_K1_N1_b4_G128_P1":
                                                 entry(16, 1)}}
    tuned = {"gpu": "NVIDIA H200", "entries": {won: entry(128, 2), same: entry(128, 1), lost: entry(64, 1),
                                               noise: entry(16, 2)}}
    rows = [_row("Mixtral-8x22B", "down", 256, "128x2", "128x1", 350.0, 410.0),   # 0.85: kept
            _row("Mixtral-8x7B", "gate_up", 512, "128x1", "128x1", 300.0, 400.0),  # same configuration: not kept
            _row("Qwen3-30B-A3B", "down", 1024, "64x1", "128x1", 110.0, 100.0),    # slower: not kept
            _row("DeepSeek-V3", "gate_up", 256, "16x2", "16x1", 98.0, 100.0),      # 0.98, within noise: not kept
            dict(model="Mixtral-8x7B", phase="layer", m=256, this_us=1.0, other_us=2.0, this_checksum="a",
                 other_checksum="a")]                                              # layer rows have no key
    shipped_dir, candidate_dir = tmp_path / "shipped", tmp_path / "candidate"
    for folder in (shipped_dir, candidate_dir):
        folder.mkdir()
        (folder / "NVIDIA_H200.json").write_text(json.dumps(shipped))
    (tmp_path / "tuned.json").write_text(json.dumps(tuned))
    (tmp_path / "race.json").write_text(json.dumps(rows))
    assert tool.main(["accept", str(tmp_path / "tuned.json"), str(tmp_path / "race.json"), str(shipped_dir)]) == 0
    out = json.loads((shipped_dir / "NVIDIA_H200.json").read_text())
    assert out["gpu"] == "NVIDIA H200"
    assert out["entries"] == {**shipped["entries"], won: entry(128, 2)}
    assert f"keep {won}" in capsys.readouterr().out
    assert tool.main(["merge", str(tmp_path / "tuned.json"), str(candidate_dir)]) == 0
    merged = json.loads((candidate_dir / "NVIDIA_H200.json").read_text())["entries"]
    assert merged == {**shipped["entries"], **tuned["entries"]}
