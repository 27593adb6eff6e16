"""MkDocs hooks: the benchmarks' READMEs (outside docs/) become pages of the site."""
