"""What a step does with its logits (tp_worker): the logit adjustments (penalties.py, grammar
masks in grammar_mask.py), sampling (sampling.py) and every logprob asked for (logprobs.py)."""
