"""The tooling that measures the library, above it: the library never imports it.

`sweep` (`attnperf bench`: backends against sdpa over sequence lengths, each in processes of
its own), `serving` (`--decode`, `--varlen`), `linear` (`--linear`), `report` (tables, JSON,
plots, the baseline comparison) and `tune` (`attnperf tune`: the measured CPU table that
"auto" reads). The command line, attnperf.cli, sits on top of them.
"""
