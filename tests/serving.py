"""A built setup over a model a test already holds, for ``build_service``."""

from forerun.build import Options, build


def setup_for(model, method: str = "ngram", draft_model=None, **options):
    """``build``'s setup for ``method`` over ``model`` (loaded by the test), as ``forerun serve``
    builds it; method draft takes its loaded ``draft_model``."""
    if draft_model is not None:
        options.setdefault("draft", draft_model.name)
    return build(Options(model.name, method=method, serving=True, **options), target=model, draft_model=draft_model)
