"""meshpar's user-facing error, in a module that imports nothing from meshpar, so every module
(recipe, mesh, models, tensor parallel, preflight) can raise it without importing the others."""


class RecipeError(ValueError):
    """A recipe problem the user can fix: the message names the key and the remedy.

    ``key`` ("section.key") lets the loader say where the offending value came from: the
    recipe file or a command-line override.
    """

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key
