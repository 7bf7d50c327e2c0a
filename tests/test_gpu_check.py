"""tools/gpu_check.sh, the retune stage: tune -> candidate checkout -> race -> accepted table. CPU only: the two GPU
steps (the tuner and the race) are stand-ins, a `python3` first on PATH; everything else runs as on the GPU."""
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_moe import configs
from cupy_moe.models import get_model

ROOT = Path(__file__).resolve().parents[1]
GPU = "NVIDIA H200"

# The stand-in: `-m cupy_moe tune` writes TUNED into $CUPY_MOE_CACHE_DIR; tools/compare_versions.py records where it
# ran and what its checkout's table holds, writes RACE to its --json file and exits RACE_STATUS; the rest runs for real.
STUB = """#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
if args[:3] == ["-m", "cupy_moe", "tune"]:
    sys.path.insert(0, os.getcwd())
    from cupy_moe.configs.tuned import save_tuned
    save_tuned({gpu!r}, json.loads(os.environ["TUNED"]), os.environ["CUPY_MOE_CACHE_DIR"])
    sys.exit(0)
if args[:1] == ["tools/compare_versions.py"]:
    table = os.path.join("cupy_moe", "configs", "tuned", {file!r})
    with open(os.environ["RACE_LOG"], "w") as f:
        json.dump(dict(cwd=os.getcwd(), other=args[1], table=json.load(open(table))["entries"],
                       cache=os.listdir(os.environ["CUPY_MOE_CACHE_DIR"])), f)
    with open(args[args.index("--json") + 1], "w") as f:
        f.write(os.environ["RACE"])
    sys.exit(int(os.environ["RACE_STATUS"]))
sys.exit(subprocess.call([{python!r}] + args))
"""


def _key(model, phase, m):
    shape = get_model(model)
    k, n, _ = shape.phases()[phase]
    return configs.tuning_key(shape.num_experts, k, n, 4, 128, m * shape.top_k)


def _run_stage(tmp_path, tuned, race, race_status):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "python3"
    stub.write_text(STUB.format(python=sys.executable, gpu=GPU, file=configs.table_file_name(GPU)))
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    # $OUT relative to the checkout, and the candidate (mktemp) deeper than the checkout: the race runs there and
    # must still write under $OUT
    scratch = tmp_path / "t" / "m" / "p"
    scratch.mkdir(parents=True)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", TMPDIR=str(scratch),
               OUT=os.path.relpath(tmp_path / "out", ROOT), STAGES="retune", RETUNE_M="256", TUNED=json.dumps(tuned),
               RACE=json.dumps(race), RACE_STATUS=str(race_status), RACE_LOG=str(tmp_path / "race_log.json"))
    env.pop("CUPY_MOE_CACHE_DIR", None)
    done = subprocess.run(["bash", "tools/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    return done, tmp_path / "out"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_retune_stage_ships_only_the_entries_that_won_the_race(tmp_path):
    won, lost = _key("Mixtral-8x22B", "down", 256), _key("Qwen3-30B-A3B", "gate_up", 256)
    tuned = {won: {"block_m": 64, "split_k": 2, "warps_k": 1, "time_us": 1.0},
             lost: {"block_m": 48, "split_k": 1, "warps_k": 1, "time_us": 1.0}}
    race = [dict(model="Mixtral-8x22B", phase="down", m=256, this_config="64/2/tc", other_config="128/2/tc",
                 this_us=300.0, other_us=340.0),
            dict(model="Qwen3-30B-A3B", phase="gate_up", m=256, this_config="48s/1/swapped",
                 other_config="16/1/reg", this_us=99.0, other_us=100.0)]
    # exit status 1: the race's outputs differ, as they may where another configuration adds in another order
    done, out = _run_stage(tmp_path, tuned, race, race_status=1)
    assert "retune rc=0" in done.stdout, done.stdout + done.stderr
    log = json.loads((tmp_path / "race_log.json").read_text())
    # the race ran in a copy of the checkout holding every tuned entry, against this checkout, with no user table
    assert Path(log["cwd"]) != ROOT and Path(log["other"]) == ROOT and log["cache"] == []
    assert log["table"][won] == tuned[won] and log["table"][lost] == tuned[lost]
    name = configs.table_file_name(GPU)
    shipped = json.loads((ROOT / "cupy_moe" / "configs" / "tuned" / name).read_text())["entries"]
    accepted = json.loads((out / "retune" / "accepted" / name).read_text())["entries"]
    assert accepted[won] == tuned[won]                       # 0.88 of the time: kept
    assert accepted.get(lost) == shipped.get(lost)           # 0.99: the shipped entry (or none) stays
    assert {k: v for k, v in accepted.items() if k != won} == {k: v for k, v in shipped.items() if k != won}
    assert "keep " + won in (out / "retune.txt").read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_retune_stage_fails_when_the_race_fails(tmp_path):
    key = _key("Mixtral-8x22B", "down", 256)
    done, out = _run_stage(tmp_path, {key: {"block_m": 64, "split_k": 2, "warps_k": 1, "time_us": 1.0}}, [], 2)
    assert re.search(r"retune rc=[1-9]", done.stdout), done.stdout + done.stderr
    assert not (out / "retune" / "accepted").exists()
