"""A built setup over a model a test already holds, for ``build_service``."""

from forerun.build import Options, build


def setup_for(model, method: str = "ngram", **options):
    """``build``'s setup for ``method`` over ``model`` (loaded by the test), as ``forerun serve`` builds it."""
    return build(Options(model.name, method=method, serving=True, **options), target=model)
