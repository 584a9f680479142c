"""The benchmarks behind `kvcmas bench ...` and `kvcmas run`, and the tasks they score.

- core.py: `bench core` (prefill/decode tokens/s, peak RSS; optionally against llama.cpp and torch)
- agents.py: `bench agents` (its command line); its parts: sharing_speed.py (TTFT, KV memory), sharing_fidelity.py
  (correction state, fidelity), accuracy.py (task accuracy, `--task`), concurrency.py (`--concurrent`),
  cold_start.py (`--cold-start`), report.py (their tables and plots), progress.py (the progress bar)
- serve.py: `bench serve` (workflows replayed against kvcmas-server)
- attention.py: `bench attention` (the corrected attention kernel, through kvcmas_cpp._testing)
- vision.py: `bench vision` · constrained.py: `bench constrained`
- demo.py: `kvcmas run` (the 4-agent team, nonshared vs kvcmas)
- tasks/: the data sets and their scoring (GSM8K, MMLU, HumanEval) and the sandbox that runs generated code
"""
