"""Rank 0's main-thread stack, sampled every STACKS_S seconds into
$STACKS_DIR/stacks-<pid>.txt (gpu_session.sh's ``STACKS=<seconds>`` puts this directory
on PYTHONPATH; ``python -m benchmarks.stack_summary FILE`` reads the file).

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

    def _sample(path: str, every: float, main: int) -> None:
        t0 = time.time()
        while True:
            time.sleep(every)
            frame = sys._current_frames().get(main)
            if frame is None:
                return  # the main thread has ended
            text = "".join(traceback.format_stack(frame)[-40:])
            del frame  # a frame kept through the sleep keeps its locals alive (W3: the backward's
            # gradients, seen by graphcomp's pool ledger as "still referenced": 66 re-captures)
            with open(path, "a") as f:
                f.write(f"=== t={time.time() - t0:.1f}s\n{text}\n")

    os.makedirs(os.environ["STACKS_DIR"], exist_ok=True)
    threading.Thread(
        target=_sample, name="graphcomp-stack-sampler", daemon=True,
        args=(os.path.join(os.environ["STACKS_DIR"], f"stacks-{os.getpid()}.txt"),
              float(os.environ.get("STACKS_S", "10")), threading.main_thread().ident),
    ).start()
