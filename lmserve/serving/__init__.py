"""Serving machinery: the inference worker (scheduler), jobs and their request handles, the KV
slot pool with its disk tier and RAM guard, and sampling."""
