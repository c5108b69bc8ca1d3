"""The samples run end to end, shortened: samples/train_lm.py trains, plots and hands weights back to torch;
samples/resume_lm.py resumes a killed run bit for bit; samples/distributed_lm.py trains on 2 ranks with ZeRO,
aggregates the rank files with the checkpoint CLI and generates text from the result."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ort_trainer import checkpoint
from tests.ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in the sample's output:\n{text}"
    return float(match.group(1))


@pytest.mark.processes
def test_train_lm_sample_learns_and_writes_the_loss_curve(tmp_path):
    out = tmp_path / "out"
    command = [
        sys.executable,
        str(ROOT / "samples" / "train_lm.py"),
        "--steps",
        "30",
        "--eval-every",
        "10",
        "--checkpoint-every",
        "20",
    ]
    result = subprocess.run(
        [*command, "--out", str(out)],
        cwd=tmp_path,  # the sample must not depend on the working directory
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"

    png = out / "loss.png"
    assert png.read_bytes()[:8] == PNG_MAGIC, f"{png} is not a PNG"
    summary = next((line for line in result.stdout.splitlines() if line.startswith("summary:")), "")
    assert f"png={png}" in summary, summary
    # the manager's checkpoints (steps 20 and 30, asynchronous): the latest holds the whole run
    latest = checkpoint.CheckpointManager(out / "checkpoints").latest()
    assert latest.step == 30 and set(latest.metrics) == {"eval_loss"}, latest
    assert f"checkpoint={latest.path}" in summary
    saved = checkpoint.load(latest.path)
    assert saved["train_step_info"]["step"] == 30, saved["train_step_info"]
    assert len(checkpoint.decode_user_dict(saved["user_dict"])["train_losses"]) == 30
    assert "steps=30 " in summary, summary
    first = _number(r"first_train_loss=([\d.]+)", summary)
    last = _number(r"last_train_loss=([\d.]+)", summary)
    eval_loss = _number(r"eval_loss=([\d.]+)", summary)
    # 81 characters: an untrained model costs about ln(81) = 4.39 nats; 30 steps get well below that
    assert first > 4.0, summary
    assert last < first - 0.8, summary
    assert eval_loss < first - 0.8, summary

    # the ORT -> PyTorch hand-off: the torch module with the trained weights gives ORT's eval loss
    ort_loss = _number(r"ONNX Runtime ([\d.]+)", result.stdout)
    torch_loss = _number(r"PyTorch ([\d.]+)", result.stdout)
    assert abs(ort_loss - torch_loss) < 1e-3, result.stdout
    # the text is sampled (temperature, top-k), not greedy: greedy repeats one word ("the the the ...")
    text = _generated(result.stdout)
    assert text.startswith("This License ") and len(text) == len("This License ") + 200, text
    words = text.split()[2:]
    assert len(set(words)) > 0.6 * len(words), f"the generated text repeats itself: {text!r}"


@pytest.mark.processes
def test_train_lm_and_custom_loop_rerun_in_any_order_from_one_folder(tmp_path):
    """As a user (or `make demo`) runs them: the default --out, one working directory, each sample again and after
    the other. They shared out/checkpoints: custom_loop.py then restored train_lm.py's checkpoint (not one of its
    objects) and a second train_lm.py died at its first save below the first run's last step."""
    samples = ROOT / "samples"

    def run(script, steps):
        command = [sys.executable, str(samples / script), "--steps", str(steps), "--eval-every", str(steps)]
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{script}: stdout:\n{result.stdout}\nstderr:\n{result.stderr[-3000:]}"
        return result.stdout

    out = tmp_path / "out"
    run("train_lm.py", 4)
    first_loop = run("custom_loop.py", 2)
    assert "resumed" not in first_loop, first_loop  # a folder of its own: nothing of train_lm.py's to restore
    again = run("train_lm.py", 2)  # fewer steps: its saves are below the first run's step 4
    assert f"removed the checkpoints of an earlier run in {Path('out') / 'checkpoints'}" in again, again
    assert [c.step for c in checkpoint.CheckpointManager(out / "checkpoints").checkpoints()] == [2]
    second_loop = run("custom_loop.py", 2)  # a finished run, again: it resumes at its end and trains nothing
    assert re.search(r"resumed from .*custom_loop.* \(step 2\)", second_loop), second_loop
    assert "the checkpoint is at step 2, --steps is 2: nothing to train" in second_loop, second_loop
    weights = re.search(r"weights=(\S+)", first_loop).group(1)
    assert f"weights={weights} " in second_loop, (first_loop, second_loop)  # the first run's trained module
    assert [c.step for c in checkpoint.CheckpointManager(out / "custom_loop" / "checkpoints").checkpoints()] == [2]


def _generated(stdout: str) -> str:
    """The text between the rules after 'generated:'; printed once (it was printed twice)."""
    rule = "-" * 60
    head = f"generated:\n{rule}\n"
    assert stdout.count(head) == 1, f"no (or more than one) 'generated:' block in the sample's output:\n{stdout}"
    body = stdout.split(head, 1)[1]
    assert f"\n{rule}\n" in body, stdout
    text = body.split(f"\n{rule}\n", 1)[0]
    assert stdout.count(text) == 1, f"the generated text is printed more than once:\n{stdout}"
    return text


def test_sampling_is_seeded_and_temperature_zero_is_greedy():
    sys.path.insert(0, str(ROOT / "samples"))
    try:
        from model import CharTransformer, generate
    finally:
        sys.path.remove(str(ROOT / "samples"))
    torch.manual_seed(0)
    model = CharTransformer(30, 16, 16, 2, 1, 0.0).eval()
    prompt = [1, 2, 3]

    def sample(seed, n=12, **kwargs):
        return generate(model, prompt, n, 16, generator=torch.Generator().manual_seed(seed), **kwargs)

    assert sample(7) == sample(7)  # seeded: the demo prints the same text every run
    assert sample(7) != sample(8)
    greedy = sample(7, temperature=0)
    assert sample(7, top_k=1) == greedy == sample(8, temperature=0)
    assert greedy[3] == int(model(torch.tensor([prompt]))[0, -1].argmax())
    top3 = {sample(seed, n=1, temperature=5.0, top_k=3)[3] for seed in range(20)}
    first_logits = model(torch.tensor([prompt]))[0, -1]
    assert top3 <= set(first_logits.topk(3).indices.tolist())  # never outside the top k


# -----------------------------------------------------------------------------
# samples that start processes of their own: run each in its own session, kill everything on failure,
# and check that no process of the sample outlives it.


def _processes_mentioning(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker`` (the test's unique tmp folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in entry.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:  # exited meanwhile
            continue
    return pids


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _run_sample(command: list[str], tmp_path: Path, timeout: float, env: dict | None = None):
    """Run ``command`` (which mentions ``tmp_path``) to completion; fail on a non-zero exit, a timeout or orphans.

    The sample runs in a new session so that a timeout kills its whole process group; torchrun's workers
    start sessions of their own, so leftovers are found by their command line, which names ``tmp_path``.
    """
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,  # the sample must not depend on the working directory
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _kill(_processes_mentioning(str(tmp_path)))
        stdout, stderr = proc.communicate()
        pytest.fail(f"timed out after {timeout} s\nstdout:\n{stdout}\nstderr:\n{stderr[-5000:]}")
    finally:
        leftovers = [] if proc.poll() is None else _processes_mentioning(str(tmp_path))
        _kill(leftovers)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr[-5000:]}"
    assert not leftovers, f"processes left running after the sample exited: {leftovers}"
    return stdout, stderr


@pytest.mark.processes
def test_resume_sample_continues_bit_for_bit_after_sigkill(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "samples" / "resume_lm.py"), "--demo", "--steps", "20", "--save-every", "5"]
    stdout, stderr = _run_sample([*command, "--kill-at", "13", "--out", str(out)], tmp_path, timeout=180)

    # the runs draw no progress bar on the stderr they share with the lines relayed here (they were glued on)
    assert "train:" not in stderr and "step/s" not in stderr, stderr[-2000:]
    assert "[crash run] starting fresh" in stdout and "[crash run] step 13" in stdout, stdout
    assert "[crash run] done" not in stdout, stdout  # killed, not finished
    # the newest complete checkpoint when the kill landed (step 10's background save may not have been published)
    resumed = re.search(r"\[resumed run\] resuming from ckpt-0+(\d+)\.ortcp \(step (\d+)\)", stdout)
    assert resumed and resumed.group(1) == resumed.group(2) and int(resumed.group(1)) in (5, 10), stdout
    assert "[reference run] starting fresh" in stdout, stdout
    png = out / "resume.png"
    assert png.read_bytes()[:8] == PNG_MAGIC, f"{png} is not a PNG"
    summary = next((line for line in stdout.splitlines() if line.startswith("summary:")), "")
    assert f"png={png}" in summary and f"resumed_from={resumed.group(1)} " in summary, summary
    # the resumed run equals the uninterrupted one exactly: every loss and every final weight
    assert _number(r"loss_diff=([-\d.e+]+)", summary) == 0.0, summary
    assert _number(r"weight_diff=([-\d.e+]+)", summary) == 0.0, summary
    # the manager kept the last two checkpoints and the best one, and nothing else of its own
    kept = [c.step for c in checkpoint.CheckpointManager(out / "run" / "checkpoints").checkpoints()]
    assert kept[-2:] == [15, 20] and len(kept) <= 3, kept


@pytest.mark.processes
def test_distributed_sample_trains_with_zero_aggregates_and_generates(tmp_path):
    out = tmp_path / "out"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    launcher += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    command = [*launcher, str(ROOT / "samples" / "distributed_lm.py"), "--steps", "20", "--out", str(out)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}  # gloo's own connections stay on the loopback interface too
    stdout, _ = _run_sample(command, tmp_path, timeout=180, env=env)

    latest = checkpoint.CheckpointManager(out / "checkpoints").latest()  # saved through the manager
    assert latest.step == 20 and latest.path.endswith("ckpt-000000020.ortcp.manifest.json"), latest
    files = checkpoint.check_manifest(latest.path).rank_paths()  # both rank files, sizes and CRC-32s as published
    assert [p.name.split(".")[1] for p in files] == ["rank0-of-2", "rank1-of-2"], files
    full = out / "lm-full.ortcp"
    options = checkpoint.load(full, key="trainer_options")
    assert (options["world_size"], options["zero_stage"]) == (1, 0), options
    assert "aggregated weights equal rank 0's trained weights: True" in stdout, stdout
    summary = next((line for line in stdout.splitlines() if line.startswith("summary:")), "")
    assert "world_size=2 zero_stage=1 steps=20 " in summary and f"aggregated={full}" in summary, summary
    assert _number(r"last_loss=([\d.]+)", summary) < _number(r"first_loss=([\d.]+)", summary) - 0.8, summary
    text = _generated(stdout)
    assert text.startswith("This License ") and len(text) == len("This License ") + 100, stdout

    # run again, shorter, on the same folder: it starts over (its step 10 was refused below the first run's 20)
    launcher[-1] = str(free_port())
    command = [*launcher, str(ROOT / "samples" / "distributed_lm.py"), "--steps", "10", "--out", str(out)]
    stdout, _ = _run_sample(command, tmp_path, timeout=180, env=env)
    assert f"removed the checkpoints of an earlier run in {out / 'checkpoints'}" in stdout, stdout
    assert [c.step for c in checkpoint.CheckpointManager(out / "checkpoints").checkpoints()] == [10]
    assert "world_size=2 zero_stage=1 steps=10 " in stdout, stdout


@pytest.mark.processes
@pytest.mark.hf_long  # three runs of ~40 s of CPU each (the graphs come from the graph cache after the first)
def test_custom_loop_sample_learns_and_resumes_a_killed_run_bit_for_bit(tmp_path):
    """samples/custom_loop.py: a loop over ORTModule, killed with SIGKILL after step 10 (checkpoints every 4
    steps, asynchronous) and run again, ends with the weights of a run that was never interrupted."""
    command = [sys.executable, str(ROOT / "samples" / "custom_loop.py"), "--steps", "12", "--eval-every", "6"]
    command += ["--checkpoint-every", "4"]

    def run(out, *extra):
        return subprocess.run(
            [*command, "--out", str(out), *extra], cwd=tmp_path, capture_output=True, text=True, timeout=600
        )

    whole = run(tmp_path / "whole")
    assert whole.returncode == 0, f"stdout:\n{whole.stdout}\nstderr:\n{whole.stderr}"
    first, last = _number(r"first_eval=([\d.]+)", whole.stdout), _number(r"last_eval=([\d.]+)", whole.stdout)
    assert last < first - 0.5, whole.stdout  # AdamW + cosine + clipping over ORTModule learns
    killed = run(tmp_path / "killed", "--kill-after", "10")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = run(tmp_path / "killed")
    assert resumed.returncode == 0, f"stdout:\n{resumed.stdout}\nstderr:\n{resumed.stderr}"
    assert re.search(r"resumed from .* \(step [48]\)", resumed.stdout), resumed.stdout  # 8, unless its save was cut
    weights = re.search(r"weights=(\S+)", whole.stdout).group(1)
    assert f"weights={weights} " in resumed.stdout, (whole.stdout, resumed.stdout)
