"""graphcomp benchmark harness: one model, every system, one launcher.

Run ``torchrun --nproc-per-node N -m benchmarks.run --workload W1 --systems ...``
(see ``benchmarks/README.md``). Modules:

- ``workloads``: workload table (W1/W2/W3/smoke), model build + identical init, data
- ``systems``: the torch-native systems (fsdp2, fsdp2_compile, ddp, ddp_compile, inductor)
- ``external``: systems from other packages (graphcomp and its ablations, DeepSpeed)
- ``measure``: timing, memory, matmul rate, profiler idle share, environment facts
- ``report``: JSON / markdown / PNG writers, loss parity, targets
- ``run``: the CLI (``main(argv)``)
"""
