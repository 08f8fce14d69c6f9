"""agentrl.evaluation: ``agentrl eval`` (runner, metrics, reports). Imports no torch unless a local model
is evaluated.
"""

from agentrl.evaluation.config import EvalConfig
from agentrl.evaluation.metrics import ERROR_KINDS, maj_at_k, pass_at_k, summarize
from agentrl.evaluation.runner import Evaluation

__all__ = ["ERROR_KINDS", "EvalConfig", "Evaluation", "maj_at_k", "pass_at_k", "summarize"]
