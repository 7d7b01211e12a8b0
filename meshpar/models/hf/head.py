"""Whether a causal LM's logits are its output embedding alone, applied to its last hidden states.

[Note: the head the chunked loss applies]
``train.loss_chunks`` runs the base model, then the output embedding a chunk of tokens at a time
(meshpar/training/loss.py). That equals the causal LM's own logits only where its forward returns
the output embedding's output unchanged, applied to the base model's last hidden states unchanged:
a scale (Granite's ``logits_scaling``, Cohere's ``logit_scale``), a soft-cap (Gemma 2) or anything
else after the head breaks it. ``head_alone`` checks exactly that by reading the causal LM's forward
(its source, parsed): ``logits`` must be assigned once, as the head called on the base model's last
hidden states (``outputs.last_hidden_state``, ``outputs[0]``, or a slice of them), and never changed
after. Where it is not shown, ``head`` is None: the loss takes whole logits, and an explicit
``train.loss_chunks`` > 1 is refused before launch.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn


def head_alone(causal_lm: type[nn.Module], head_name: str) -> bool:
    """Whether ``causal_lm``'s forward returns its output embedding ``head_name`` applied to its base
    model's last hidden states, with nothing after ([Note: the head the chunked loss applies])."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(causal_lm.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    assigns = [(node.lineno, target.id, node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
               for target in node.targets if isinstance(target, ast.Name)]
    assigns += [(node.lineno, node.target.id, None) for node in ast.walk(tree)
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name)]
    logits = [(line, value) for line, name, value in assigns if name == "logits"]
    if len(logits) != 1:
        return False
    line, call = logits[0]
    if not (isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords
            and ast.unparse(call.func) == f"self.{head_name}"):
        return False
    arg = call.args[0].value if isinstance(call.args[0], ast.Subscript) else call.args[0]
    if not isinstance(arg, ast.Name):
        return False
    sources = [value for at, name, value in assigns if name == arg.id and at < line]

    def hidden(value: ast.expr | None) -> bool:  # outputs.last_hidden_state, outputs[0], or a slice of tokens
        text = ast.unparse(value) if value is not None else ""
        return (text.endswith(".last_hidden_state") or text.endswith("[0]")
                or text.startswith(f"slice_logits_to_keep({arg.id},"))

    return bool(sources) and all(hidden(v) for v in sources)
