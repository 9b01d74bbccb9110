"""ENTMTP as an SGLang speculative algorithm (placeholder until the worker lands)."""


def register_algorithm() -> None:
    pass
