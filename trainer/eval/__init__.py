"""Evaluation of a converted model: HumanEval pass@k (sandboxed execution) and perplexity.

- :mod:`trainer.eval.config`: the ``eval`` section and the protocol's facts (torch-free).
- :mod:`trainer.eval.humaneval`: problems, programs, pass@k; :mod:`trainer.eval.sandbox`: execution.
- :mod:`trainer.eval.generate`: batched sampling; :mod:`trainer.eval.perplexity`: held-out and JSONL.
- :func:`trainer.eval.run.run_eval`: the stage's work from one :class:`~trainer.eval.run.EvalRun`.
"""
