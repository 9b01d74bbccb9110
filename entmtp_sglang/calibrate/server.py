"""Start SGLang servers on this machine and talk to them: used by the tests, the benchmarks and the docs.

    with SGLangServer.cpu(speculative="ENTMTP", port=31010) as srv:
        out = srv.generate("def f(x):", max_new_tokens=32)

`SGLangServer.cpu(...)` builds the command line SGLang needs on a CPU (SGLANG_USE_CPU_ENGINE=1,
`--device cpu`, our `entmtp_torch` attention backend, no CUDA graphs, `--sleep-on-idle` so an idle
scheduler does not spin a core) for the bundled model and its EAGLE drafter. Only the standard library
is used to talk HTTP; SGLang itself runs in the child process.

No orphans: the server runs in its own process group (SGLang forks a scheduler and a detokenizer), and
`stop()` terminates the whole group, then kills what is left. The server also gets SIGTERM from the kernel
when the thread that started it dies (Linux `PR_SET_PDEATHSIG`), so a benchmark killed with SIGKILL does
not leave a server behind either; start servers from the main thread for that reason.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..model.load import BUNDLED_MODEL


class ServerError(RuntimeError):
    pass


_ISSUED: set[int] = set()   # ports free_port() handed out in this process


def free_port() -> int:
    """A TCP port nobody listens on now and not handed out before by this process (servers started together
    each get their own). Another process may still take it before the server binds it: `wait_ready` then
    restarts the server on a new port."""
    import socket

    for _ in range(64):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _ISSUED:
            _ISSUED.add(port)
            return port
    raise ServerError("no free TCP port found in 64 tries")


def cpu_args(speculative: str | None, *, model: Path = BUNDLED_MODEL, steps: int = 3, topk: int = 1,
             draft_tokens: int = 4, adaptive: bool = False, attention: str = "entmtp_torch",
             max_total_tokens: int = 20000, extra: tuple[str, ...] = (), draft: str = "eagle") -> list[str]:
    """sglang.launch_server arguments for the bundled model on CPU; `draft`: the drafter's folder in `model`."""
    args = ["--model-path", str(model), "--device", "cpu", "--attention-backend", attention,
            "--disable-cuda-graph", "--max-total-tokens", str(max_total_tokens), "--sleep-on-idle",
            "--log-level", "info"]
    if speculative == "NGRAM":
        # SGLang's NGRAM drafts from the text already written (a corpus of earlier requests' and this request's
        # tokens), no draft model; its own defaults for the rest (topk = its BFS breadth), `draft_tokens` per step
        return args + ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(draft_tokens),
                       *extra]
    if speculative:
        args += ["--speculative-algorithm", speculative, "--speculative-draft-model-path", str(model / draft)]
    if speculative == "EAGLE":
        args += ["--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
                 "--speculative-num-draft-tokens", str(draft_tokens)]
        if adaptive:
            args.append("--speculative-adaptive")
        if (model / draft / "draft_vocab.safetensors").exists() and "--speculative-token-map" not in extra:
            # as ENTMTP does by itself (sglang/token_map.py): the drafter drafts over its own vocabulary
            from ..model.load import draft_token_map

            args += ["--speculative-token-map", str(draft_token_map(model / draft))]
    return args + list(extra)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask the kernel for SIGTERM when the parent (the thread that started us) dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_all(servers) -> None:
    """Stop several servers at once: every one asked to exit first, then each waited for (their shutdowns overlap)."""
    servers = [s for s in servers if s is not None]
    for s in servers:
        if isinstance(s, SGLangServer):
            s.terminate()
    for s in servers:
        s.wait_stopped() if isinstance(s, SGLangServer) else s.stop()   # (a stand-in with only `stop`)


class SGLangServer:
    def __init__(self, args: list[str], port: int, env: dict[str, str] | None = None,
                 log_path: Path | None = None, timeout_s: float = 600.0):
        self.args, self.port = list(args), port
        cpu = "--device" in args and args[args.index("--device") + 1] == "cpu"
        self.env = {**os.environ, **({"SGLANG_USE_CPU_ENGINE": "1"} if cpu else {}), **(env or {})}
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix=f"sglang-{port}-",
                                                                             suffix=".log")[1])
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    @classmethod
    def cpu(cls, speculative: str | None = None, port: int | None = None, env: dict[str, str] | None = None,
            log_path: Path | None = None, **kw) -> "SGLangServer":
        return cls(cpu_args(speculative, **kw), port or free_port(), env, log_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", *self.args, "--port", str(self.port)]

    def start(self, wait: bool = True) -> "SGLangServer":
        cmd = self.command()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        if wait:
            self.wait_ready()
        return self

    def _port_taken(self) -> bool:
        """SGLang's HTTP server could not bind its port (taken between free_port() and the bind); SGLang does not
        exit then, it waits forever."""
        return f"('127.0.0.1', {self.port}): address already in use" in self.log_text()

    def wait_ready(self, restarts: int = 3) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if restarts > 0 and self._port_taken():
                taken = self.port
                self.stop()
                self.port, restarts = free_port(), restarts - 1
                print(f"SGLang could not bind port {taken} (another process took it); restarting on {self.port}",
                      file=sys.stderr, flush=True)
                self.start(wait=False)
                deadline = time.monotonic() + self.timeout_s
                continue
            if self.proc.poll() is not None:
                raise ServerError(f"SGLang exited with code {self.proc.returncode} during start-up:\n"
                                  f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"SGLang did not become ready in {self.timeout_s:.0f} s:\n{self.log_tail()}")

    def exit_code(self, timeout_s: float = 300.0) -> int:
        """For servers expected to fail at start-up: wait for the exit and return its code."""
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self) -> None:
        """Terminate the server and every process it started (its process group); kill what remains."""
        self.terminate()
        self.wait_stopped()

    def terminate(self) -> None:
        """Ask the server's process group to exit (SIGTERM), without waiting: `stop_all` stops several at once."""
        if self.proc is not None and (self.proc.poll() is None or _group_alive(self.proc.pid)):
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)   # the server leads its own process group (start_new_session)
            except (ProcessLookupError, PermissionError):
                pass

    def wait_stopped(self) -> None:
        """Wait for a terminated server's process group to exit; kill what remains after the grace period."""
        if self.proc is not None:
            pgid = self.proc.pid
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            deadline = time.monotonic() + 10
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _group_alive(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if self.proc.poll() is None:
                self.proc.wait(10)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "SGLangServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- requests -----------------------------------------------------------------------------------
    def post(self, path: str, payload: dict | None = None, timeout_s: float = 600.0) -> dict:
        data = json.dumps(payload or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            raise ServerError(f"{path}: HTTP {e.code}: {e.read()[:500]!r}") from None
        try:
            return json.loads(body) if body else {}
        except json.JSONDecodeError:     # some endpoints (/flush_cache) answer in plain text
            return {"text": body.decode(errors="replace")}

    def generate(self, text: str, max_new_tokens: int = 32, temperature: float = 0.0, **sampling) -> dict:
        params = {"temperature": temperature, "max_new_tokens": max_new_tokens, **sampling}
        return self.post("/generate", {"text": text, "sampling_params": params})

    def generate_ids(self, input_ids: list[int], max_new_tokens: int = 32, temperature: float = 0.0,
                     **sampling) -> dict:
        """/generate on token ids (no tokenizer round trip: the server sees exactly these tokens)."""
        params = {"temperature": temperature, "max_new_tokens": max_new_tokens, **sampling}
        return self.post("/generate", {"input_ids": list(input_ids), "sampling_params": params})

    def flush_cache(self, timeout_s: float = 60.0) -> None:
        """Empty the radix (prefix) cache, so a measurement does not reuse an earlier one's prefill. SGLang flushes
        only an idle scheduler (a request just answered may still be leaving it): it waits up to `timeout_s` for
        that, then answers HTTP 400 (a ServerError here)."""
        self.post(f"/flush_cache?timeout={timeout_s:g}")

    def server_info(self) -> dict:
        with urllib.request.urlopen(self.url + "/get_server_info", timeout=60) as r:
            info = json.loads(r.read())
        states = info.get("internal_states") or [{}]
        return {**info, **states[0]}
