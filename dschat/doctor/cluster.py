"""The doctor's launcher check: this machine's versions, the master port, and a hostfile's hosts (each resolves, is
this machine or answers on ssh, and runs the same dschat and torch)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import ipaddress
import json
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from dschat.doctor.report import ERROR, OK, WARN, Report
from dschat.errors import UserError

SSH_PORT = 22


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """``(host, slots)`` of a DeepSpeed hostfile (``host slots=N`` per line, ``#`` comments); a line of any other
    shape, or a host named twice, is a ``UserError`` naming the file and line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{p}: hostfile not found")
    hosts: list[tuple[str, int]] = []
    for lineno, raw in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].startswith("slots=") or not fields[1][6:].isdigit() \
                or int(fields[1][6:]) < 1:
            raise UserError(f"{p}:{lineno}: expected 'hostname slots=N' (N >= 1), got {line!r}")
        if any(h == fields[0] for h, _ in hosts):
            raise UserError(f"{p}:{lineno}: host {fields[0]} is listed twice")
        hosts.append((fields[0], int(fields[1][6:])))
    if not hosts:
        raise UserError(f"{p}: no hosts")
    return hosts


def _local_addresses() -> set[str]:
    out = set()
    for name in {socket.gethostname(), socket.getfqdn()}:
        with contextlib.suppress(OSError):
            out |= {str(i[4][0]) for i in socket.getaddrinfo(name, None)}
    return out


def _is_local(host: str, addresses: set[str]) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    for a in addresses:
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(a.split("%")[0]).is_loopback:
                return True
    return bool(addresses & _local_addresses())


def local_versions() -> dict[str, str]:
    """The versions of what a rank imports, read from package metadata (nothing is imported)."""
    out = {"python": ".".join(map(str, sys.version_info[:3]))}
    for pkg in ("dschat", "torch", "deepspeed", "transformers"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out


# Run on a remote host with this machine's interpreter path (as DeepSpeed's launcher does): its package versions.
_REMOTE_PROBE = ("import importlib.metadata as m, json\nout = {}\nfor p in ('dschat', 'torch'):\n    try:\n"
                 "        out[p] = m.version(p)\n    except Exception:\n        out[p] = 'missing'\n"
                 "print(json.dumps(out))")


def check_launcher(report: Report, hostfile: str | None, master_port: int | None, timeout: float) -> None:
    mine = local_versions()
    report.add("launcher", ERROR if "missing" in (mine["dschat"], mine["torch"]) else OK,
               "this machine: " + ", ".join(f"{k} {v}" for k, v in mine.items()))
    if master_port is not None:
        with socket.socket() as s:
            try:
                s.bind(("", master_port))
                report.add("launcher", OK, f"--master-port {master_port} is free on this machine")
            except OSError as e:
                report.add("launcher", ERROR, f"--master-port {master_port} is in use on this machine "
                                              f"({e.strerror}); choose another or leave it out (a free one is picked)")
    if not hostfile:
        return
    try:
        hosts = parse_hostfile(hostfile)
    except UserError as e:
        report.add("launcher", ERROR, str(e))
        return
    report.add("launcher", OK, f"{hostfile}: {len(hosts)} host(s), {sum(s for _, s in hosts)} slots")
    for i, (host, _) in enumerate(hosts):
        try:
            addresses = {str(a[4][0]) for a in socket.getaddrinfo(host, SSH_PORT, type=socket.SOCK_STREAM)}
        except OSError as e:
            report.add("launcher", ERROR, f"host {host}: does not resolve ({getattr(e, 'strerror', None) or e})")
            continue
        if _is_local(host, addresses):
            report.add("launcher", OK, f"host {host}: this machine")
            continue
        if not _answers(sorted(addresses), SSH_PORT, timeout):
            report.add("launcher", ERROR, f"host {host} ({', '.join(sorted(addresses))}): does not answer on ssh port "
                                          f"{SSH_PORT} within {timeout:g}s")
            continue
        _remote_versions(host, mine, timeout, report)
        if i == 0 and master_port is not None:
            report.add("launcher", WARN, f"--master-port {master_port}: the rendezvous runs on {host}, where the "
                                         "port was not checked")


def _answers(addresses: list[str], port: int, timeout: float) -> bool:
    for a in addresses:
        with contextlib.suppress(OSError), socket.create_connection((a, port), timeout=timeout):
            return True
    return False


def _remote_versions(host: str, mine: dict[str, str], timeout: float, report: Report) -> None:
    """dschat and torch on ``host`` as ssh sees them, without a password prompt (BatchMode); a warning when ssh
    does not get in."""
    if shutil.which("ssh") is None:
        report.add("launcher", WARN, f"host {host}: answers on port {SSH_PORT}; versions not checked (no ssh client)")
        return
    # ssh hands the remote shell one command line: each word quoted for it
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}", host,
           shlex.quote(sys.executable), "-c", shlex.quote(_REMOTE_PROBE)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 20)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode == 255:
        why = (done.stderr.strip().splitlines() or ["?"])[-1][:120] if done is not None else "timed out"
        report.add("launcher", WARN, f"host {host}: answers on port {SSH_PORT}, but ssh does not log in without a "
                                     f"prompt ({why}); versions not checked")
        return
    try:
        theirs = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        report.add("launcher", ERROR, f"host {host}: {sys.executable} does not run there "
                                      f"({(done.stderr.strip().splitlines() or ['?'])[-1][:120]})")
        return
    differ = [f"{p} {theirs.get(p)} (here {mine[p]})" for p in ("dschat", "torch") if theirs.get(p) != mine[p]]
    if differ:
        report.add("launcher", ERROR, f"host {host}: " + ", ".join(differ))
    else:
        report.add("launcher", OK, f"host {host}: reachable by ssh, dschat {mine['dschat']}, torch {mine['torch']}")
