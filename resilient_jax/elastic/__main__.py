"""`python -m resilient_jax.elastic status --run DIR` | `drain --run DIR --host H` | `worker ...` (started by a launcher)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _driver_gone(info: Path) -> str | None:
    """Why the driver that wrote controller.json is not running any more (killed: it removes the
    file when it exits), or None. Only a driver on this machine can be checked."""
    import os
    import socket

    try:
        controller = json.loads(info.read_text())
        pid, host = int(controller["pid"]), controller.get("host")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return (f"the run is not running: its driver (pid {pid}) is gone without finishing (killed?); what "
                "follows is its last status. Rerun the train command to resume from the last checkpoint")
    except PermissionError:
        pass  # alive, another account's
    return None


def _run_over(run_dir: Path, status: dict | None = None) -> str | None:
    """How the run ended, when no driver is running it (it removes controller.json as it exits)."""
    info = run_dir / "elastic" / "controller.json"
    if info.is_file():
        return _driver_gone(info)
    if status and status.get("error"):  # summary.json, if any, is an earlier invocation's
        return "the run is over: it failed (the error is below)"
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return "the run is not running (no controller.json, no summary.json)"
    stopped = summary.get("stopped")
    how = f"stopped ({stopped})" if stopped else "finished"
    return (f"the run is over: {how} at step {summary.get('final_step')}, fingerprint "
            f"{str(summary.get('params_fingerprint'))[:16]}")


def status(run_dir: Path) -> int:
    path = run_dir / "elastic" / "status.json"
    if not path.is_file():
        print(f"error: {path} not found: is {run_dir} the run.dir of an elastic run?", file=sys.stderr)
        return 2
    st = json.loads(path.read_text())
    over = _run_over(run_dir, st)
    if over:
        print(over)
    print(f"controller {st['controller']}  generation {st['generation']}  step {st['step']}"
          f"{'  finished' if st['finished'] else ''}{'  stopping (' + st['stopping'] + ')' if st.get('stopping') else ''}"
          f"{'  ERROR: ' + st['error'] if st['error'] else ''}")
    print(f"{'host':<8}{'region':<10}{'status':<12}{'gen':>5}{'step':>7}{'step s':>9}")
    for host, m in st["members"].items():
        print(f"{host:<8}{m['region']:<10}{m['status']:<12}{m['generation']:>5}{m['step']:>7}{m['step_seconds']:>9.3f}")
    for event in st["events"]:
        print(f"generation {event['generation']}: {event['reason']}"
              + (f" lost {','.join(event['lost'])}" if event["lost"] else "")
              + (f" took out {','.join(event['reslotted'])}" if event.get("reslotted") else "")
              + (f" joined {','.join(event['joined'])}" if event["joined"] else "")
              + f" resume at step {event['resume_step']}"
              + (f" from the checkpoint {event['from_checkpoint']}" if event.get("from_checkpoint") else ""))
    return 0


def drain(run_dir: Path, host: str) -> int:
    """Ask the run's controller to take `host` out of the world at the next step boundary."""
    from resilient_jax.elastic.channel import ControllerClient, ControllerError

    info, token_file = run_dir / "elastic" / "controller.json", run_dir / "elastic" / "token"
    over = _run_over(run_dir) if (run_dir / "elastic").is_dir() else None
    if over:
        print(f"error: drain {host}: {over}; nothing to drain", file=sys.stderr)
        return 2
    if not info.is_file():
        print(f"error: {info} not found: is {run_dir} the run.dir of a running elastic run?", file=sys.stderr)
        return 2
    try:  # the token is 0600, the run's owner's: another account cannot drain the run
        token = token_file.read_text().strip() if token_file.is_file() else ""
        controller = json.loads(info.read_text())
    except (OSError, ValueError) as e:
        where, why = getattr(e, "filename", None) or info, getattr(e, "strerror", None) or e
        advice = "; run drain as the account that started the run" if isinstance(e, PermissionError) else ""
        print(f"error: drain {host}: cannot read the run's {where} ({why}){advice}", file=sys.stderr)
        return 2
    try:  # an https controller is verified against the CA the run recorded (runtime.tls)
        ca_pem = Path(controller["tls_ca"]).read_text() if controller.get("tls_ca") else ""
        client = ControllerClient(controller["url"], token, ca_pem=ca_pem)
    except (OSError, ValueError) as e:
        print(f"error: drain {host}: cannot use the run's TLS CA {controller.get('tls_ca')} ({e})", file=sys.stderr)
        return 2
    try:
        pending = client.call("/drain", retry_seconds=5, host=host)["pending"]
    except ControllerError as e:
        print(f"error: drain {host}: {e}" + ("; is the run still running?" if "unreachable" in str(e) else ""),
              file=sys.stderr)
        return 2
    print(f"drain {host}: it leaves at the next step boundary"
          + (f"; spare {pending['spare']} takes its slot" if pending["spare"] else "; no spare, the world shrinks"))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        from resilient_jax.elastic.worker import main as worker_main

        return worker_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m resilient_jax.elastic")
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="members, generation and step of a run")
    st.add_argument("--run", required=True, type=Path, help="the run's run.dir")
    dr = sub.add_parser("drain", help="take a host out of the running world at the next step boundary")
    dr.add_argument("--run", required=True, type=Path, help="the run's run.dir")
    dr.add_argument("--host", required=True, help="host id, e.g. h2 (see `status`)")
    sub.add_parser("worker", help="(started by a launcher) one host of an elastic run")
    args = parser.parse_args(argv)
    return drain(args.run, args.host) if args.command == "drain" else status(args.run)


if __name__ == "__main__":
    sys.exit(main())
