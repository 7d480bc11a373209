"""Experiment configuration: shared config pieces (``base``), scheme-option strings
(``scheme_options``) and the command line (``command_line``)."""
