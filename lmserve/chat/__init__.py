"""A model's chat format, both ways: requests into prompts (the chat template, hermes tools for
templates without them) and sampled tokens back into events (UTF-8 detokenizing, the reply router
for reasoning and tool calls, stop strings, and the grammars that constrain a reply).

Imports run one way: core (types, events) and model (tokenizer, template) below it, serving and
http above it.
"""
