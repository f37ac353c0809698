"""Records which functions of the repository each process runs, and which file called which
(benchmarks/request_path.py puts this folder on PYTHONPATH, so every Python process of the service imports it at
start; nothing else does).

A profile hook (sys.setprofile and threading.setprofile: Python 3.11 has no sys.monitoring) notes each function
of ours that runs, and each call between two of them or between one and a carrier between our processes (Ray
Serve, the engine process's pipe, the ASGI server): the caller is the nearest such frame up the stack, so a call
made through a library (asyncio, logging, pydantic) counts as its caller's. A thread rewrites
`<LS_PATH_TRACE>/<pid>.txt` every 0.2 s and starts over whenever the file `<LS_PATH_TRACE>/reset` changes, so a
window of the run can be told apart from start-up.
"""
import os
import sys

_out = os.environ.get("LS_PATH_TRACE")
if _out:
    import threading
    import time

    _root = os.environ["LS_PATH_TRACE_ROOT"].rstrip("/") + "/"
    _CARRIERS = (("/ray/serve/", "<serve>"), ("/multiprocessing/connection.py", "<pipe>"),
                 ("/starlette/", "<asgi>"), ("/fastapi/", "<asgi>"), ("/uvicorn/", "<asgi>"))
    _labels: dict = {}     # code object -> "file:qualname" of ours, a carrier or None (any other library)
    _seen: set = set()

    def _label(code):
        try:
            return _labels[code]
        except KeyError:
            name = code.co_filename
            if name.startswith(_root) and "/.venv/" not in name:
                qualname = code.co_qualname
                if qualname.endswith("<lambda>"):   # lambdas of one function share a name: told apart by line
                    qualname += f"@{code.co_firstlineno}"
                label = f"{name[len(_root):]}:{qualname}"
                _seen.add(label)
            else:
                label = next((carrier for part, carrier in _CARRIERS if part in name), None)
            _labels[code] = label
            return label

    def _note(frame, event, arg):
        if event != "call":
            return
        callee = _label(frame.f_code)
        if callee is None:
            return
        caller, depth = frame.f_back, 0
        while caller is not None and depth < 60:
            label = _label(caller.f_code)
            if label is not None:
                if label != callee:
                    _seen.add(f"{label} -> {callee}")
                return
            caller, depth = caller.f_back, depth + 1

    sys.setprofile(_note)
    threading.setprofile(_note)

    def _write_forever():
        sys.setprofile(None)
        path, last = f"{_out}/{os.getpid()}.txt", None
        while True:
            time.sleep(0.2)
            try:
                mark = os.stat(f"{_out}/reset").st_mtime_ns
            except FileNotFoundError:
                mark = None
            if mark != last:
                last = mark
                _labels.clear()
                _seen.clear()
            with open(path + ".tmp", "w") as f:
                f.write("\n".join(sorted(list(_seen))))
            os.replace(path + ".tmp", path)

    threading.Thread(target=_write_forever, daemon=True, name="path-trace").start()
