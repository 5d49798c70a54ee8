"""glm_fused.launcher: environment of each rank, error reports, and no leftover processes."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from glm_fused import launcher
from glm_fused.launcher import current_rank, launch, world_size

if __package__:
    from . import launcher_workers as workers
else:
    import launcher_workers as workers

W = workers.__name__
ROOT = Path(launcher.__file__).resolve().parent.parent
# Where a separate Python finds both glm_fused and the workers module.
PYTHONPATH = os.pathsep.join([str(ROOT), str(Path(workers.__file__).parent)])
JOB_VARS = ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "FLAGS_selected_gpus")


@pytest.fixture(autouse=True)
def clean_env():
    """No job variables from outside, and none left behind by a joined launch."""
    saved = dict(os.environ)
    for name in [*JOB_VARS, *(n for n in os.environ if n.startswith("GLM_FUSED_"))]:
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def notes(out: Path) -> dict[int, dict]:
    found = (json.loads(p.read_text()) for p in out.glob("rank*.json"))
    return {n["rank"]: n for n in found}


def all_pids(out: Path) -> list[int]:
    return [pid for n in notes(out).values() for pid in [n["pid"], *n.get("children", [])]]


def alive(pid: int) -> bool:
    """True while pid runs (a zombie has finished, it only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_until(condition, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def kept_dir(stderr: str) -> Path:
    """The rank-log directory an error message names (removed by the test)."""
    match = re.search(r"(\S*glm_fused-ranks-[^/\s)]+)", stderr)
    assert match, stderr
    return Path(match.group(1))


def start_parent(out: Path, nprocs: int = 2) -> subprocess.Popen:
    """A launcher in its own process, so the test can signal or kill it."""
    code = ("import sys; from glm_fused.launcher import launch; "
            f"sys.exit(launch({W + ':sleep_forever'!r}, {{'out': {str(out)!r}}}, nprocs={nprocs}))")
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    assert wait_until(lambda: len(notes(out)) == nprocs, 15), "ranks did not start"
    return parent


# ---- helpers and one process -----------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_reader_that_leaves_early_ends_the_run_quietly(tmp_path, nprocs):
    """`script | head`: rank 0's output pipe closes; the run stops with the shell's status for
    that (141), no traceback and no error line, nothing left running."""
    code = ("import sys; from glm_fused.launcher import launch; "
            f"sys.exit(launch({W + ':print_lines'!r}, {{'out': {str(tmp_path)!r}, 'lines': 200000}}, "
            f"nprocs={nprocs}))")
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert parent.stdout.read(10) == b"line 0 xxx"
    parent.stdout.close()
    err = parent.stderr.read().decode()
    assert parent.wait(30) == 141, err
    assert "Traceback" not in err and "error" not in err, err
    pids = [n["pid"] for n in notes(tmp_path).values()]
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 10)


def test_rank_helpers_read_the_environment(monkeypatch):
    assert (current_rank(), world_size()) == (0, 1)
    monkeypatch.setenv("PADDLE_TRAINER_ID", "2")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")
    assert (current_rank(), world_size()) == (2, 4)
    monkeypatch.setenv("GLM_FUSED_RANK", "1")
    monkeypatch.setenv("GLM_FUSED_WORLD_SIZE", "2")
    assert (current_rank(), world_size()) == (1, 2)


def test_one_rank_runs_in_this_process(tmp_path):
    assert launch(f"{W}:record_env", {"out": str(tmp_path)}, nprocs=1) == 0
    note = notes(tmp_path)[0]
    assert note["pid"] == os.getpid()
    assert note["env"]["GLM_FUSED_RANK"] is None  # no distributed environment
    assert note["env"]["MASTER_PORT"] is None and note["env"]["PADDLE_TRAINER_ID"] is None
    assert note["args_type"] == "dict"
    # The device is named for the backends, for the duration of the call only.
    assert launch(f"{W}:record_env", {"out": str(tmp_path)}, nprocs=1, device="gpu") == 0
    env = notes(tmp_path)[0]["env"]
    assert (env["GLM_FUSED_DEVICE"], env["GLM_FUSED_DEVICE_ID"]) == ("gpu", "0")
    assert "GLM_FUSED_DEVICE" not in os.environ


def test_one_rank_keeps_a_namespace_and_returns_the_worker_status(tmp_path):
    args = argparse.Namespace(out=tmp_path, codes=[3], delays=[0])  # a Path travels as str
    assert launch(f"{W}:exit_with", args, nprocs=1) == 3
    assert launch(workers.record_env, argparse.Namespace(out=str(tmp_path)), nprocs=1) == 0
    assert notes(tmp_path)[0]["args_type"] == "Namespace"


def test_args_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="JSON"):
        launch(f"{W}:record_env", {"out": object()}, nprocs=1)


def test_one_rank_errors(tmp_path, capfd):
    args = {"out": str(tmp_path), "bad": [0], "kind": "user", "message": "no model at /x"}
    assert launch(f"{W}:fail", args, nprocs=1) == 2
    assert capfd.readouterr().err == "error: no model at /x\n"
    assert launch(f"{W}:fail", {**args, "kind": "internal", "message": "boom"}, nprocs=1) == 1
    err = capfd.readouterr().err
    assert "Traceback" in err and "RuntimeError: boom" in err


def test_one_rank_timeout(tmp_path, capfd):
    start = time.monotonic()
    assert launch(f"{W}:exit_with", {"out": str(tmp_path), "codes": [0], "delays": [30]},
                  nprocs=1, timeout=0.5) == 124
    assert time.monotonic() - start < 5
    assert capfd.readouterr().err == "error: timed out after 0.5s\n"


# ---- joining a job started by someone else ---------------------------------------------


def test_joins_a_paddle_launch_job(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    assert launch(f"{W}:record_env", {"out": str(tmp_path)}, nprocs=2) == 0
    note = notes(tmp_path)[1]
    assert note["pid"] == os.getpid()
    env = note["env"]
    assert (env["GLM_FUSED_RANK"], env["GLM_FUSED_WORLD_SIZE"]) == ("1", "2")
    assert (env["GLM_FUSED_DEVICE"], env["GLM_FUSED_DIST_BACKEND"]) == ("cpu", "gloo")

    assert launch(f"{W}:record_env", {"out": str(tmp_path)}, nprocs=4) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: --tp 4 does not match the 2 ranks") and "--tp 2" in err


def test_joins_a_torchrun_job(tmp_path, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert launch(f"{W}:record_env", {"out": str(tmp_path)}, nprocs=2, device="gpu",
                  num_gpus=1) == 0
    env = notes(tmp_path)[0]["env"]
    assert (env["GLM_FUSED_RANK"], env["GLM_FUSED_WORLD_SIZE"]) == ("0", "2")
    assert (env["GLM_FUSED_DEVICE_ID"], env["GLM_FUSED_DIST_BACKEND"]) == ("0", "gloo")
    assert env["PADDLE_TRAINER_ID"] == "0"


# ---- N processes -----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_each_rank_gets_its_environment(tmp_path, capfd):
    assert launch(f"{W}:record_env", {"out": str(tmp_path)}, nprocs=3) == 0
    found = notes(tmp_path)
    assert sorted(found) == [0, 1, 2]
    envs = [found[r]["env"] for r in range(3)]
    endpoints = envs[0]["PADDLE_TRAINER_ENDPOINTS"].split(",")
    assert len(set(endpoints)) == 3 and all(e.startswith("127.0.0.1:") for e in endpoints)
    master = f"{envs[0]['MASTER_ADDR']}:{envs[0]['MASTER_PORT']}"
    assert master == envs[0]["PADDLE_MASTER"] and master not in endpoints
    for rank, env in enumerate(envs):
        assert found[rank]["pid"] != os.getpid()
        assert env["GLM_FUSED_RANK"] == env["PADDLE_TRAINER_ID"] == env["RANK"] == str(rank)
        assert env["GLM_FUSED_WORLD_SIZE"] == env["PADDLE_TRAINERS_NUM"] == env["WORLD_SIZE"] == "3"
        assert env["PADDLE_CURRENT_ENDPOINT"] == endpoints[rank]
        assert env["PADDLE_TRAINER_ENDPOINTS"] == envs[0]["PADDLE_TRAINER_ENDPOINTS"]
        assert env["PADDLE_MASTER"] == master and env["LOCAL_RANK"] == str(rank)
        assert (env["GLM_FUSED_DEVICE"], env["GLM_FUSED_DEVICE_ID"]) == ("cpu", "0")
        assert env["GLM_FUSED_DIST_BACKEND"] == env["PADDLE_DISTRI_BACKEND"] == "gloo"
        assert env["FLAGS_selected_gpus"] is None
        assert env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 3))
    out = capfd.readouterr()
    assert out.out == "hello from rank 0\n"  # the other ranks write to their logs
    assert out.err == ""
    assert not Path(envs[1]["GLM_FUSED_ERROR_FILE"]).parent.exists()  # logs removed


@pytest.mark.timeout(30)
def test_gpu_ranks_share_or_own_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the user's choice stays
    assert launch(f"{W}:record_env", {"out": str(tmp_path)}, nprocs=3, device="gpu",
                  num_gpus=2) == 0
    envs = [notes(tmp_path)[r]["env"] for r in range(3)]
    assert [e["GLM_FUSED_DEVICE_ID"] for e in envs] == ["0", "1", "0"]
    assert [e["FLAGS_selected_gpus"] for e in envs] == ["0", "1", "0"]
    assert {e["GLM_FUSED_DIST_BACKEND"] for e in envs} == {"gloo"}  # two ranks share GPU 0
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"7"}

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert launch(f"{W}:record_env", {"out": str(tmp_path)}, nprocs=2, device="gpu") == 0
    envs = [notes(tmp_path)[r]["env"] for r in range(2)]
    assert {e["GLM_FUSED_DIST_BACKEND"] for e in envs} == {e["PADDLE_DISTRI_BACKEND"]
                                                           for e in envs} == {"nccl"}


def test_gpu_without_gpus_is_a_user_error(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert launch(f"{W}:record_env", {"out": str(tmp_path)}, nprocs=2, device="gpu") == 2
    assert capfd.readouterr().err.startswith("error: --device gpu, but no GPU is visible")


@pytest.mark.timeout(30)
def test_user_error_on_one_rank(tmp_path, capfd):
    args = {"out": str(tmp_path), "bad": [1], "kind": "user", "message": "no model at /x"}
    assert launch(f"{W}:fail", args, nprocs=2) == 2
    assert capfd.readouterr().err == "error: rank 1: no model at /x\n"


@pytest.mark.timeout(30)
def test_same_user_error_on_every_rank_is_said_once(tmp_path, capfd):
    args = {"out": str(tmp_path), "bad": [0, 1], "kind": "user", "message": "no model at /x",
            "stubborn": True}  # so both ranks get to report, whichever is seen first
    assert launch(f"{W}:fail", args, nprocs=2) == 2
    assert capfd.readouterr().err == "error: no model at /x\n"


@pytest.mark.timeout(30)
def test_internal_error_on_one_rank(tmp_path, capfd):
    args = {"out": str(tmp_path), "bad": [1], "kind": "internal", "message": "boom"}
    assert launch(f"{W}:fail", args, nprocs=2) == 1
    err = capfd.readouterr().err
    kept = kept_dir(err)
    try:
        assert err.count("Traceback") == 1 and 'launcher_workers.py", line' in err
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: rank 1: RuntimeError: boom (its output: ")
        assert "RuntimeError: boom" in (kept / "rank1.log").read_text()
    finally:
        shutil.rmtree(kept)


@pytest.mark.timeout(30)
def test_ranks_that_finish_early_are_fine_and_a_status_is_passed_on(tmp_path, capfd):
    args = {"out": str(tmp_path), "codes": [0, 0], "delays": [0, 0.3]}
    assert launch(f"{W}:exit_with", args, nprocs=2) == 0
    args = {"out": str(tmp_path), "codes": [0, 3], "delays": [0, 0]}
    assert launch(f"{W}:exit_with", args, nprocs=2) == 3
    err = capfd.readouterr().err
    shutil.rmtree(kept_dir(err))
    assert err.startswith("error: rank 1 exited with status 3")


@pytest.mark.timeout(30)
def test_a_hung_rank_is_killed_when_another_fails(tmp_path, capfd):
    # Ranks 0 and 1 ignore SIGINT and SIGTERM, as a rank stuck in a collective would.
    args = {"out": str(tmp_path), "bad": [2], "kind": "user", "message": "bad", "stubborn": True,
            "grandchildren": True}
    start = time.monotonic()
    assert launch(f"{W}:fail", args, nprocs=3) == 2
    assert time.monotonic() - start < launcher.GRACE_S + 5
    assert capfd.readouterr().err == "error: rank 2: bad\n"
    pids = all_pids(tmp_path)
    assert len(pids) == 6
    assert wait_until(lambda: not any(map(alive, pids)), 2), [p for p in pids if alive(p)]


@pytest.mark.timeout(30)
def test_timeout_stops_every_rank(tmp_path, capfd):
    start = time.monotonic()
    assert launch(f"{W}:sleep_forever", {"out": str(tmp_path)}, nprocs=2, timeout=1) == 124
    assert time.monotonic() - start < 1 + launcher.GRACE_S + 2
    err = capfd.readouterr().err
    shutil.rmtree(kept_dir(err))
    assert err.startswith("error: timed out after 1s")
    assert not any(map(alive, all_pids(tmp_path)))


@pytest.mark.timeout(30)
def test_ranks_die_with_a_killed_launcher(tmp_path):
    parent = start_parent(tmp_path)
    ranks = [n["pid"] for n in notes(tmp_path).values()]
    parent.kill()
    parent.wait()
    assert wait_until(lambda: not any(map(alive, ranks)), 3), [p for p in ranks if alive(p)]
    # Nobody was left to remove the launcher's directory, nor to stop the ranks' own children.
    shutil.rmtree(Path(notes(tmp_path)[0]["env"]["GLM_FUSED_ERROR_FILE"]).parent)
    for note in notes(tmp_path).values():
        for pid in note["children"]:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_sigterm_to_the_launcher_stops_everything(tmp_path):
    parent = start_parent(tmp_path)
    parent.send_signal(signal.SIGTERM)
    _, err = parent.communicate(timeout=launcher.GRACE_S + 5)
    assert parent.returncode == 143, err
    pids = all_pids(tmp_path)
    assert wait_until(lambda: not any(map(alive, pids)), 1), [p for p in pids if alive(p)]
    assert b"Traceback" not in err


@pytest.mark.timeout(30)
def test_a_worker_defined_in_the_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import sys
        from glm_fused.launcher import current_rank, launch

        def work(args):
            print(f"{args['word']} from rank {current_rank()}", flush=True)

        if __name__ == "__main__":
            print("launching", flush=True)
            sys.exit(launch(work, {"word": "hi"}, nprocs=2))
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=20)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "launching\nhi from rank 0\n"


# ---- real collectives through the launcher's environment -------------------------------


@pytest.mark.timeout(120)
def test_paddle_gloo_all_reduce(tmp_path):
    pytest.importorskip("paddle")
    assert launch(f"{W}:paddle_all_reduce", {"out": str(tmp_path)}, nprocs=4, timeout=110) == 0
    assert {r: n["value"] for r, n in notes(tmp_path).items()} == {r: 10.0 for r in range(4)}


@pytest.mark.timeout(90)
def test_torch_gloo_all_reduce(tmp_path):
    # Two ranks prove torch's variables as well as four, at half the start-up cost.
    pytest.importorskip("torch")
    assert launch(f"{W}:torch_all_reduce", {"out": str(tmp_path)}, nprocs=2, timeout=80) == 0
    assert {r: n["value"] for r, n in notes(tmp_path).items()} == {0: 3.0, 1: 3.0}
