"""The one exception type users see: raised for bad input and unusable models or files (an
``OptionError`` where an option is bad: named as the caller names it)."""

import string


class ForerunError(Exception):
    """A user-facing error: the CLI prints it as one line and exits non-zero."""


class OptionError(ForerunError):
    """A bad option, said in the caller's terms. The message is a template whose fields name the
    options (``{draft_window}``); the library says them as its parameter names (``draft_window``),
    the command line as its flags (``--draft-window``, see ``said``). Other fields are values
    (``OptionError("{tree_depth} must be >= 1, got {got}", got=depth)``)."""

    def __init__(self, template: str, **values):
        self.template, self.values = template, values
        super().__init__(self.said(lambda name: name))

    @property
    def options(self) -> list[str]:
        """The options the message names, in order."""
        fields = [f for _, f, _, _ in string.Formatter().parse(self.template) if f]
        return [f for f in dict.fromkeys(fields) if f not in self.values]

    def said(self, name) -> str:
        """The message with every option named by ``name(option)``."""
        return self.template.format(**{f: name(f) for f in self.options}, **self.values)
