"""dschat doctor: each planted fault is found as one finding, and the demo's own set-up passes.

The tiny preset's folder is the saved model every test starts from (copied, then damaged or changed); the data
files are written here. A full disk is simulated by replacing ``shutil.disk_usage`` as the doctor sees it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import subprocess
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from dschat.cli.doctor import doctor_command
from dschat.demo import demo_data
from dschat.doctor import ERROR, OK, WARN, histogram, parse_hostfile, read_safetensors_header, run_doctor
from dschat.doctor import output as doctor_output
from dschat.doctor.plan import GPUMemory, check_gpus
from dschat.doctor.report import Report
from dschat.models.loading import resolve_model
from dschat.training import lock
from dschat.training.lock import acquire, release
from tests.families import build_family
from tests.helpers import run_cli

# A ChatML template that drops the reasoning of every assistant turn but the last, as reasoning models' templates
# do: a conversation rendered whole differs from the same conversation rendered turn by turn.
STRIPPING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\\n' + m['content'].split('</think>')[-1] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return Path(resolve_model("tiny"))


def model_copy(tiny_dir: Path, dest: Path) -> Path:
    shutil.copytree(tiny_dir, dest)
    return dest


def findings_of(findings, check: str, severity: str) -> list[str]:
    return [f.message for f in findings if f.check == check and f.severity == severity]


def errors(findings) -> list[str]:
    return [f"{f.check}: {f.message}" for f in findings if f.severity == ERROR]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def step1(tmp_path: Path, gpu_reader=list, **flags) -> list:
    """The doctor on stage 1's flags; no GPUs unless ``gpu_reader`` gives some, whatever this host has."""
    return run_doctor(1, {"output_dir": str(tmp_path / "out"), **flags}, default_data=demo_data,
                      gpu_reader=gpu_reader)


# ------------------------------------------------------------------------------------------------ planted faults
def test_a_chat_template_that_rewrites_earlier_turns_is_an_error(tmp_path):
    from transformers import AutoTokenizer

    folder = build_family("qwen2", tmp_path)  # byte-level BPE with Qwen's ChatML template, which round-trips
    turns = [{"role": "user", "content": "What is 1 + 1?"},
             {"role": "assistant", "content": "<think>one and one</think>2"},
             {"role": "user", "content": "And 2 + 2?"}, {"role": "assistant", "content": "<think>two and two</think>4"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": turns}] * 40)
    found = step1(tmp_path, model=str(folder), data=[data], data_split="1,0,0")
    assert not errors(found), errors(found)
    assert any("round-trips a multi-turn conversation" in m for m in findings_of(found, "template", OK))

    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = STRIPPING_TEMPLATE
    tok.save_pretrained(folder)
    found = step1(tmp_path, model=str(folder), data=[data], data_split="1,0,0")
    bad = findings_of(found, "template", ERROR)
    assert len(bad) == 1 and "does not round-trip" in bad[0] and "<think>2 plus 3 is 5." in bad[0], found
    assert any("multi-turn rows train only their last answer" in m for m in findings_of(found, "data", WARN))


def test_pad_equal_to_eos_in_a_saved_folder_is_found(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    folder = model_copy(tiny_dir, tmp_path / "pad_eos")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.pad_token = tok.eos_token
    tok.save_pretrained(folder)
    found = step1(tmp_path, model=str(folder))
    warned = findings_of(found, "tokenizer", WARN)
    assert len(warned) == 1 and "pad is its EOS" in warned[0] and "never learns to stop" in warned[0]
    assert "dschat pads with '<unk>'" in warned[0]  # what the stage pads with instead (ensure_distinct_pad)


def test_thirty_percent_of_prompts_over_the_prompt_limit_warns(tmp_path):
    short = [{"prompt": f"\n\nHuman: where is order {i}?\n\nAssistant:"} for i in range(70)]
    long = [{"prompt": "\n\nHuman: " + "please check my parcel again " * 12 + f"{i}\n\nAssistant:"}
            for i in range(30)]
    data = write_jsonl(tmp_path / "prompts.jsonl", short + long)
    found = run_doctor(3, {"actor_model": "tiny", "reward_model": "tiny", "data": [data], "data_split": "0,0,1",
                           "max_prompt_seq_len": 32, "output_dir": str(tmp_path / "out")})
    warned = [m for m in findings_of(found, "data", WARN) if "--max-prompt-seq-len" in m]
    assert len(warned) == 1 and warned[0].startswith("30 of 100 prompts (30%)"), found
    assert not errors(found), errors(found)


def test_rows_all_too_long_leave_no_data_an_error(tmp_path):
    found = step1(tmp_path, max_seq_len=8)
    bad = findings_of(found, "data", ERROR)
    assert len(bad) == 1 and "no usable rows" in bad[0] and "dropped_too_long" in bad[0]


def test_a_malformed_row_names_its_file_and_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": \n',
                    encoding="utf-8")
    bad = findings_of(step1(tmp_path, data=[str(data)]), "data", ERROR)
    assert len(bad) == 1 and bad[0].startswith(f"{data}:2: malformed JSON (Expecting value")

    # one row without its 'rejected' among good ones: the stage drops it and goes on, so a warning naming it
    good = [{"prompt": f"\n\nHuman: where is order {i}?\n\nAssistant:", "chosen": " It ships today.",
             "rejected": " No."} for i in range(20)]
    write_jsonl(data, good + [{"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": " Hello."}])
    found = step1(tmp_path, data=[str(data)], data_split="1,0,0")
    assert findings_of(found, "data", WARN) == [f"dropped a malformed row: {data}:21: missing field 'rejected' "
                                                 "(has: chosen, prompt)"]
    assert not errors(found) and any("dropped: malformed 1" in m for m in findings_of(found, "data", OK))


def test_unreachable_hosts_and_a_busy_master_port_are_errors(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\nnohost.invalid slots=1\n192.0.2.1 slots=2  # TEST-NET\n")
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        found = run_doctor(1, {"max_seq_len": 1}, hostfile=str(hostfile), master_port=port, connect_timeout=0.5)
    launcher = [f for f in found if f.check == "launcher"]
    assert [f.severity for f in launcher if "host " in f.message] == [OK, ERROR, ERROR]
    assert any("nohost.invalid: does not resolve" in f.message for f in launcher)
    assert any("192.0.2.1" in f.message and "does not answer on ssh port 22" in f.message for f in launcher)
    assert any(f"--master-port {port} is in use" in m for m in findings_of(found, "launcher", ERROR))
    assert findings_of(found, "flags", ERROR) == ["--max-seq-len must be >= 2, got 1"]  # and nothing else ran


def test_a_hostfile_line_of_another_shape_names_its_line(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# nodes\nnode1 slots=8\nnode2 8\n")
    with pytest.raises(Exception, match=r"hostfile:3: expected 'hostname slots=N'"):
        parse_hostfile(str(hostfile))
    hostfile.write_text("node1 slots=8\nnode2 slots=4\n")
    assert parse_hostfile(str(hostfile)) == [("node1", 8), ("node2", 4)]


def test_a_full_disk_is_an_error(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(doctor_output.shutil, "disk_usage", lambda _: usage(10**9, 10**9 - 4096, 4096))
    bad = findings_of(step1(tmp_path), "output", ERROR)
    assert len(bad) == 1 and "4.0 KiB free on its disk" in bad[0] and "checkpoints need about" in bad[0]


def test_a_truncated_safetensors_file_and_a_missing_shard_are_errors(tmp_path, tiny_dir):
    folder = model_copy(tiny_dir, tmp_path / "truncated")
    weights = folder / "model.safetensors"
    header, size = read_safetensors_header(weights)
    assert size == weights.stat().st_size and "__metadata__" in header
    with open(weights, "r+b") as f:
        f.truncate(size - 1000)
    bad = findings_of(step1(tmp_path, model=str(folder)), "model", ERROR)
    assert bad == [f"--model {weights}: truncated: {size - 1000} bytes, the header describes {size}; copy or "
                   "download it again"]

    sharded = model_copy(tiny_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    bad = findings_of(step1(tmp_path, model=str(sharded)), "model", ERROR)
    assert len(bad) == 1 and "lists 2 shards, 1 missing (model-00002-of-00002.safetensors)" in bad[0]


def test_remote_code_without_trust_is_an_error(tmp_path, tiny_dir):
    folder = model_copy(tiny_dir, tmp_path / "remote")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "modeling.Model"}}))
    bad = findings_of(step1(tmp_path, model=str(folder)), "model", ERROR)
    assert len(bad) == 1 and "pass --trust-remote-code" in bad[0]
    found = step1(tmp_path, model=str(folder), trust_remote_code=True)
    assert any("runs Python code shipped with the model" in m for m in findings_of(found, "model", WARN))


def test_a_live_lock_and_an_earlier_run_are_errors(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    acquire(out)
    try:
        bad = findings_of(step1(tmp_path), "output", ERROR)
    finally:
        release(out)
    assert len(bad) == 1 and "is in use by another run (pid" in bad[0]
    (out / "eval.json").write_text("{}")
    bad = findings_of(step1(tmp_path), "output", ERROR)
    assert len(bad) == 1 and "already holds a finished run" in bad[0]
    assert not findings_of(step1(tmp_path, force=True), "output", ERROR)


def test_a_refused_flag_is_one_error_finding(tmp_path):
    found = step1(tmp_path, lora_alpha=8.0)
    assert [(f.check, f.severity, f.message) for f in found if f.severity == ERROR] == [
        ("flags", ERROR, "--lora-alpha has no effect without --lora-dim > 0 (no LoRA)")]


def test_histogram_counts_power_of_two_bins():
    # 3 -> bin 4, 5 and 8 -> bin 8, 9 -> bin 16; median of [3, 5, 8, 9] is index 2 = 8
    assert histogram([9, 3, 8, 5]) == "n=4 median 8 p95 9 max 9 [▄█▄] <=4:1 <=8:2 <=16:1"


# ------------------------------------------------------------------------------------------------ the demo passes
@pytest.mark.parametrize("step", [1, 2])
def test_the_demo_set_up_passes(step, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output folder, output/<stage>, lands here
    result = CliRunner().invoke(doctor_command, ["--step", str(step)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1].endswith(", 0 error(s)")
    assert f"phase {step}:" in result.output and "\nok    model     --model " in result.output


def test_the_demo_set_up_passes_for_stage_3(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    actor = model_copy(tiny_dir, tmp_path / "output" / "step1_sft" / "model")  # stand-ins for the stage outputs
    reward = model_copy(tiny_dir, tmp_path / "output" / "step2_reward" / "model")
    result = CliRunner().invoke(doctor_command, ["--step", "3", "--actor-model", str(actor), "--reward-model",
                                                 str(reward), "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert not [f for f in found if f["severity"] == ERROR]
    assert {f["check"] for f in found} >= {"flags", "model", "tokenizer", "data", "output", "launcher", "plan"}


@pytest.mark.slow
def test_the_command_exits_1_with_one_line_per_finding():
    done = run_cli("doctor", "--step", "1", "--max-seq-len", "abc", timeout=300)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout.splitlines()[0].startswith("error flags     Invalid value for '--max-seq-len'")


# ------------------------------------------------------------------------------------------------ the lock on NFS
def lock_findings(found) -> list:
    """The output check's findings after its first (writable, free space): the lock's, and an earlier run's."""
    return [f for f in found if f.check == "output" and not f.message.startswith("--output-dir ")]


@pytest.mark.parametrize("code", [errno.EBADF, errno.EACCES, errno.ENOLCK])
def test_a_refused_flock_is_one_finding_judged_by_the_note(tmp_path, monkeypatch, code):
    """NFS refuses flock (EBADF on a file open read-only, EACCES, ENOLCK without a lock daemon): the doctor says so
    in one line and judges by the holder's note, as the run itself would (``lock_state``), never a traceback."""
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        note = {"pid": holder.pid, "host": socket.gethostname(), "proc_start": lock._proc_start(holder.pid),
                "started": "2026-01-01 00:00:00"}
        (out / lock.LOCK_NAME).write_text(json.dumps(note))

        def refuse(fd, op):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(fcntl, "flock", refuse)
        found = lock_findings(step1(tmp_path))
        name = errno.errorcode[code]
        assert [(f.severity, "\n" in f.message) for f in found] == [(ERROR, False)], found
        assert f"is in use by another run (pid {holder.pid}" in found[0].message
        assert f"; flock refused ({name}: {os.strerror(code)}), so judged by its note); wait" in found[0].message
    finally:
        holder.kill()
        holder.wait()
    found = lock_findings(step1(tmp_path))
    assert [f.severity for f in found] == [WARN], found
    assert found[0].message.endswith(f"which names a run that is gone (pid {holder.pid} on host "
                                     f"{socket.gethostname()}, started 2026-01-01 00:00:00)")


def test_a_refused_flock_makes_the_run_lock_by_its_note(tmp_path, monkeypatch):
    """The run (``acquire``) meets the same refusal: it takes the folder by the note, and a second run sees it."""
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.EBADF, "Bad fd")))
    note = acquire(out)
    try:
        assert json.loads((out / lock.LOCK_NAME).read_text())["nonce"] == note["nonce"]
        state = lock.lock_state(out)
        assert state is not None and state.refusal == "flock refused (EBADF: Bad fd)"
        assert not state.held  # our own process: not another run
    finally:
        release(out)
    assert not (out / lock.LOCK_NAME).exists()  # a note lock is removed on release


def test_a_lock_file_this_user_cannot_open_for_writing_is_an_error(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / lock.LOCK_NAME).write_text("{}")
    real_open = os.open

    def no_write(path, flags, *a):
        if str(path).endswith(lock.LOCK_NAME) and flags & os.O_RDWR:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *a)

    monkeypatch.setattr(lock.os, "open", no_write)
    bad = [m for m in findings_of(step1(tmp_path), "output", ERROR) if lock.LOCK_NAME in m]
    assert bad == [f"{out / lock.LOCK_NAME}: cannot open it for writing (Permission denied); the run opens it for "
                   "writing and would stop there: remove it if no run uses the folder, or choose another --output-dir"]


# ------------------------------------------------------------------------------------------------ GPUs
def test_each_gpu_the_run_uses_is_checked_against_the_plan():
    # peak 10 GiB: GPU 0 has 12 free (fits), GPU 1 has 6 (74 of 80 held elsewhere); a third is asked for
    gib = 1024**3
    gpus = [GPUMemory(0, "Fake-80GB", 12 * gib, 80 * gib), GPUMemory(1, "Fake-80GB", 6 * gib, 80 * gib)]
    report = Report()
    check_gpus(SimpleNamespace(peak_bytes=10 * gib), gpus, 3, report)
    assert [(f.check, f.severity, f.message) for f in report.findings] == [
        ("gpu", ERROR, "--num-gpus 3: only 2 GPU(s) visible here; lower --num-gpus or check CUDA_VISIBLE_DEVICES"),
        ("gpu", OK, "GPU 0 (Fake-80GB): 12.00 GiB free of 80.00 GiB, room for the plan's peak of 10.00 GiB per device"),
        ("gpu", ERROR, "GPU 1 (Fake-80GB): 6.00 GiB free of 80.00 GiB (74.00 GiB held by other processes), less than "
                       "the plan's peak of 10.00 GiB per device; free it or pick other GPUs (CUDA_VISIBLE_DEVICES)")]
    quiet = Report()
    check_gpus(SimpleNamespace(peak_bytes=10 * gib), [], None, quiet)  # a host without GPUs: nothing to say
    check_gpus(None, gpus, None, quiet)  # no plan: nothing to check against
    assert quiet.findings == []


def test_the_doctor_plans_for_the_visible_gpus_and_checks_their_free_memory(tmp_path):
    gib = 1024**3
    asked = []

    def reader():
        asked.append(1)
        return [GPUMemory(0, "Busy-24GB", 1024**2, 24 * gib)]

    found = step1(tmp_path, gpu_reader=reader)
    assert asked == [1]
    plan = [f.message for f in found if f.check == "plan"]
    gpu = findings_of(found, "gpu", ERROR)
    assert len(plan) == 1 and len(gpu) == 1 and gpu[0].startswith("GPU 0 (Busy-24GB): 1.0 MiB free of 24.00 GiB")
    # the default reader on this CPU host sees no GPU: no finding, and the plan is the table's
    assert not [f for f in step1(tmp_path, gpu_reader=list) if f.check == "gpu"]


# ------------------------------------------------------------------------------------------------ malformed rows
def test_the_loader_returns_its_malformed_rows_and_the_doctor_reads_them(tmp_path):
    from transformers import AutoTokenizer

    from dschat.config import DataArgs
    from dschat.data import load_phase

    good = [{"prompt": f"\n\nHuman: where is order {i}?\n\nAssistant:", "chosen": " It ships today.",
             "rejected": " No."} for i in range(20)]
    bad = [{"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": f" Hello {i}."} for i in range(5)]
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, good + bad)
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    pd = load_phase(DataArgs(data=[str(path)], data_split="1,0,0"), 1, tok, 1234, use_cache=False,
                    log=lambda _: None)
    name = pd.sources[0]["name"]
    assert pd.counts["dropped_malformed"] == 5
    expected = [f"{path}:{line}: missing field 'rejected' (has: chosen, prompt)" for line in range(21, 26)]
    assert {r["source"] for r in pd.malformed} == {name}
    assert sorted(r["message"] for r in pd.malformed) == expected  # every one, in the split's (seeded) order
    warned = findings_of(step1(tmp_path, data=[str(path)], data_split="1,0,0"), "data", WARN)
    assert warned == [f"dropped a malformed row: {r['message']}" for r in pd.malformed[:3]] + [
        f"... and 2 more malformed rows in {name}"]


# ------------------------------------------------------------------------------------------------ the sampler
def step3(tmp_path: Path, gpu_reader=list, num_gpus: int | None = None, **flags) -> list:
    """The doctor on stage 3's flags (the tiny preset as actor and reward model, the demo prompts)."""
    return run_doctor(3, {"actor_model": "tiny", "reward_model": "tiny", "output_dir": str(tmp_path / "out"),
                          **flags}, default_data=demo_data, gpu_reader=gpu_reader, num_gpus=num_gpus)


def sampler_lines(found) -> list[tuple[str, str]]:
    return [(f.severity, f.message) for f in found if f.check == "sampler"]


SECRET = "the doctor's test secret"


def _sampler_listening(secret: str) -> tuple[str, list]:
    """A listener that proves ``secret`` as a sampler's does (in a thread); its address, and what it saw."""
    import threading

    from dschat.generation.channel import accept, listen

    sock = listen("127.0.0.1", 0)
    seen: list = []

    def serve() -> None:
        try:
            seen.append(accept(sock, secret, 30, seen.append).recv(5))
        except Exception as e:  # noqa: BLE001 - what the listener saw is what the test reads
            seen.append(e)

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{sock.getsockname()[1]}", seen


def test_a_sampler_started_apart_is_probed_with_the_run_s_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("DSCHAT_SAMPLER_TOKEN", SECRET)
    addr, _ = _sampler_listening(SECRET)
    found = step3(tmp_path, sampler=addr)
    assert sampler_lines(found) == [(OK, f"the sampler at {addr} answers and proves the run's secret")]
    assert not errors(found), errors(found)

    addr, _ = _sampler_listening("another run's secret")
    refused = sampler_lines(step3(tmp_path, sampler=addr))
    assert len(refused) == 1 and refused[0][0] == ERROR
    assert refused[0][1].startswith(f"the peer at {addr} is not this run's sampler: ")

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{closed.getsockname()[1]}"
    found = step3(tmp_path, sampler=addr)
    lines = sampler_lines(found)
    assert len(lines) == 1 and lines[0][0] == ERROR and lines[0][1].startswith(f"no sampler answers at {addr} (")
    assert lines[0][1].endswith(f"start one there with `dschat sampler --model tiny --listen {addr}`")
    assert errors(found) == [f"sampler: {lines[0][1]}"]  # the only error, on one line
    assert [f.check for f in found][-2:] == ["sampler", "launcher"]  # reported after the output folder


def test_a_sampler_started_apart_without_a_secret_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv("DSCHAT_SAMPLER_TOKEN", raising=False)
    found = step3(tmp_path, sampler="127.0.0.1:9")
    assert any("prove a shared secret" in e for e in errors(found)), errors(found)


def test_a_closed_sampler_port_fails_the_command_with_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSCHAT_SAMPLER_TOKEN", SECRET)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{closed.getsockname()[1]}"
    result = CliRunner().invoke(doctor_command, ["--step", "3", "--actor-model", "tiny", "--reward-model", "tiny",
                                                 "--sampler", addr])
    assert result.exit_code == 1, result.output
    assert f"\nerror sampler   no sampler answers at {addr} (" in result.output, result.output
    assert result.output.strip().splitlines()[-1].endswith(", 1 error(s)"), result.output


def test_without_asynchronous_rollouts_there_is_no_sampler_line(tmp_path):
    found = step3(tmp_path)
    assert not sampler_lines(found) and not errors(found), found


def test_async_rollouts_say_where_the_sampler_starts_and_check_its_gpu(tmp_path):
    gib = 1024**3
    two = [GPUMemory(0, "Fake-80GB", 70 * gib, 80 * gib), GPUMemory(1, "Fake-80GB", 79 * gib, 80 * gib)]
    assert sampler_lines(step3(tmp_path, async_rollouts=True)) == [
        (OK, "stage 3 starts a sampler on cpu (as many threads as the trainer)")]
    assert sampler_lines(step3(tmp_path, gpu_reader=lambda: two, async_rollouts=True, sampler_devices="cuda:1")) == [
        (OK, "stage 3 starts a sampler on cuda:1 (GPU 1, Fake-80GB, 79.00 GiB free)")]
    refused = errors(step3(tmp_path, gpu_reader=lambda: two, async_rollouts=True, sampler_devices="cuda:0",
                           num_gpus=1))  # (the flags' check says it first, as the run would)
    assert len(refused) == 1 and "trains on it" in refused[0] and "--sampler-share-gpu" in refused[0], refused
    two_ranks = sampler_lines(step3(tmp_path, gpu_reader=lambda: two, async_rollouts=True, sampler_devices="cuda:1",
                                    num_gpus=2))
    assert two_ranks[0][0] == ERROR and "a training rank uses GPU 1 too (--num-gpus 2)" in two_ranks[0][1]
    shared = sampler_lines(step3(tmp_path, gpu_reader=lambda: two, async_rollouts=True, sampler_devices="cuda:0",
                                 sampler_share_gpu=True))
    assert shared[0][0] == OK and "a training rank uses GPU 0 too (--sampler-share-gpu)" in shared[0][1]
    assert sampler_lines(step3(tmp_path, gpu_reader=lambda: two, async_rollouts=True, sampler_devices="cuda:3")) == [
        (ERROR, "--sampler-devices cuda:3: no GPU 3 here (2 visible: cuda:0, cuda:1); pick one of them or check "
                "CUDA_VISIBLE_DEVICES")]
    # a doctor without CUDA (run away from the GPUs): said, not checked
    assert sampler_lines(step3(tmp_path, async_rollouts=True, sampler_devices="cuda:3")) == [
        (OK, "stage 3 starts a sampler on cuda:3 (not checked: no CUDA GPU visible to the doctor here)")]
