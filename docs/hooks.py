"""mkdocs hook: the configuration reference, generated from the config's schema at every build
(``tba.config_reference``), where ``docs/configuration.md`` asks for it."""

from tba.config_reference import reference_markdown

MARKER = "<!-- configuration reference -->"


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(MARKER, reference_markdown()) if MARKER in markdown else markdown
