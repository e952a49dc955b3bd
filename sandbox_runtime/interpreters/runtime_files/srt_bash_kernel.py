"""A Jupyter kernel for bash, installed into the sandbox runtime (it runs inside sandboxes).

One persistent non-interactive bash per kernel, fed through pipes (no pseudo-terminal): each
cell is written to a file and `source`d, so the working directory, variables and functions
persist; a sentinel line with the cell's status marks its end. An interrupt (SIGINT to bash's
own process group, which its commands share) ends the running command and the cell.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading

from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel

CELL = "/tmp/.srt-bash-cell"


class BashKernel(Kernel):
    implementation = "srt_bash"
    implementation_version = "1.0"
    language = "bash"
    language_info = {"name": "bash", "mimetype": "text/x-sh", "file_extension": ".sh"}
    banner = "bash (sandbox_runtime)"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._sentinel = "__srt_done_" + secrets.token_hex(8)
        self._bash = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            start_new_session=True,  # its own process group: an interrupt signals it all
        )
        # An interrupt returns from the sourced cell (the command it ran got the SIGINT too).
        self._send("trap 'return 130 2>/dev/null' INT\n")
        self._errors = threading.Thread(target=self._pump_stderr, daemon=True)
        self._errors.start()

    def _send(self, text: str) -> None:
        assert self._bash.stdin is not None
        self._bash.stdin.write(text.encode())
        self._bash.stdin.flush()

    def _pump_stderr(self) -> None:
        assert self._bash.stderr is not None
        for line in iter(self._bash.stderr.readline, b""):
            self._stream("stderr", line.decode("utf-8", "replace"))

    def _stream(self, name: str, text: str) -> None:
        if text and self.iopub_socket is not None:
            self.send_response(self.iopub_socket, "stream", {"name": name, "text": text})

    def do_execute(
        self,
        code,
        silent,
        store_history=True,
        user_expressions=None,
        allow_stdin=False,
        *,
        cell_id=None,
    ):
        with open(CELL, "w") as cell:
            cell.write(code + "\n")
        self._send(f"source {CELL} </dev/null; printf '\\n{self._sentinel} %d\\n' $?\n")
        status = 0
        assert self._bash.stdout is not None
        pending = ""
        while True:
            try:
                chunk = os.read(self._bash.stdout.fileno(), 65536)
            except KeyboardInterrupt:  # the interrupt reached us too: bash ends the cell
                continue
            if not chunk:
                return self._died()
            pending += chunk.decode("utf-8", "replace")
            marker = pending.find("\n" + self._sentinel + " ")
            if marker >= 0 and pending.endswith("\n"):
                tail = pending[marker + 1 :].split()
                status = int(tail[1]) if len(tail) > 1 and tail[1].isdigit() else 1
                if not silent:
                    self._stream("stdout", pending[:marker])
                break
            # Send what cannot be part of the sentinel line; keep the rest for the next read.
            cut = pending.rfind("\n")
            if cut > 0 and not silent:
                self._stream("stdout", pending[:cut])
                pending = pending[cut:]
        if status != 0:
            error = {"ename": "ExitStatus", "evalue": str(status), "traceback": []}
            if status == 130:
                error = {"ename": "KeyboardInterrupt", "evalue": "interrupted", "traceback": []}
            return {"status": "error", "execution_count": self.execution_count, **error}
        return {
            "status": "ok",
            "execution_count": self.execution_count,
            "payload": [],
            "user_expressions": {},
        }

    def _died(self):
        code = self._bash.wait()
        self._stream("stderr", f"bash exited with status {code}; the kernel restarts\n")
        os.kill(os.getpid(), signal.SIGTERM)
        return {"status": "error", "ename": "BashExited", "evalue": str(code), "traceback": []}

    def _send_interrupt_children(self) -> None:
        os.killpg(self._bash.pid, signal.SIGINT)

    def do_shutdown(self, restart):
        self._bash.kill()
        return super().do_shutdown(restart)


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=BashKernel)
