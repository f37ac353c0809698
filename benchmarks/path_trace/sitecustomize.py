"""Records which functions of the repository each process runs (benchmarks/request_path.py puts this folder on
PYTHONPATH, so every Python process of the service imports it at start; nothing else does).

A profile hook (sys.setprofile and threading.setprofile: Python 3.11 has no sys.monitoring) notes each code
object once; a thread rewrites `<LS_PATH_TRACE>/<pid>.txt` every 0.2 s and starts over whenever the file
`<LS_PATH_TRACE>/reset` changes, so a window of the run can be told apart from start-up.
"""
import os
import sys

_out = os.environ.get("LS_PATH_TRACE")
if _out:
    import threading
    import time

    _root = os.environ["LS_PATH_TRACE_ROOT"].rstrip("/") + "/"
    _codes: set = set()
    _seen: set = set()

    def _note(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code not in _codes:
                _codes.add(code)
                name = code.co_filename
                if name.startswith(_root) and "/.venv/" not in name:
                    _seen.add(f"{name[len(_root):]}:{code.co_qualname}")

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
                _codes.clear()
                _seen.clear()
            with open(path + ".tmp", "w") as f:
                f.write("\n".join(sorted(list(_seen))))
            os.replace(path + ".tmp", path)

    threading.Thread(target=_write_forever, daemon=True, name="path-trace").start()
