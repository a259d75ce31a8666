"""Rank 0's stacks, sampled every STACKS_S seconds into $STACKS_DIR/stacks-<pid>.txt
(gpu_session.sh's ``STACKS=<seconds>`` puts this directory on PYTHONPATH;
``python -m benchmarks.stack_summary FILE`` reads the file).

Each sample is the main thread's stack, then (after a ``--- thread NAME`` line) the
stack of every other thread that is not idle in a queue or lock wait. On CUDA the
backward runs on an autograd device thread, so the lazily compiled backward (most of a
deep model's cold compile) is only seen there: the main thread sits in
``_engine_run_backward`` meanwhile.

A daemon thread reading ``sys._current_frames()``: pure Python, so it costs one GIL
acquisition per sample. ``faulthandler.dump_traceback_later(repeat=True)`` was tried
first and crashed a W3 process with SIGSEGV. Only the process with RANK=0 and
LOCAL_RANK=0 samples (not torchrun, which has neither, nor Inductor's compile workers,
which get no RANK)."""
import os
import sys

if os.environ.get("STACKS_DIR") and os.environ.get("RANK") == "0" and os.environ.get("LOCAL_RANK") == "0":
    import threading
    import time
    import traceback

    # innermost frames of a thread that is waiting, not working
    _IDLE = ("threading.py", "queue.py", "selectors.py", "concurrent/futures/thread.py",
             "multiprocessing/connection.py", "socket.py")

    def _sample(path: str, every: float, main: int) -> None:
        t0 = time.time()
        me = threading.get_ident()
        while True:
            time.sleep(every)
            frames = sys._current_frames()
            frame = frames.get(main)
            if frame is None:
                return  # the main thread has ended
            parts = ["".join(traceback.format_stack(frame)[-60:])]
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, f in frames.items():
                if ident in (main, me) or f.f_code.co_filename.endswith(_IDLE):
                    continue
                parts.append(f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(f)[-60:]))
            del frame, frames, f  # a frame kept through the sleep keeps its locals alive (W3: the backward's
            # gradients, seen by graphcomp's pool ledger as "still referenced": 66 re-captures)
            with open(path, "a") as out:
                out.write(f"=== t={time.time() - t0:.1f}s\n" + "".join(parts) + "\n")

    os.makedirs(os.environ["STACKS_DIR"], exist_ok=True)
    threading.Thread(
        target=_sample, name="graphcomp-stack-sampler", daemon=True,
        args=(os.path.join(os.environ["STACKS_DIR"], f"stacks-{os.getpid()}.txt"),
              float(os.environ.get("STACKS_S", "10")), threading.main_thread().ident),
    ).start()
