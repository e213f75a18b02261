"""The benchmark harness: runtime handed to programs, runners, worker, correctness and reporting.

Split into small modules so the parent process (run.py, report.py) never imports torch: each
(program, runner) cell runs in its own worker process (worker.py), which is the only place torch,
torch._lazy or terra_torch get imported. That isolation keeps a crash, a hang, a global dispatcher
interceptor or Dynamo's caches from leaking from one cell into the next.
"""
