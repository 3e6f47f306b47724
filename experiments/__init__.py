"""Experiments of the seeds' papers that are not the main K-FAC study: each
script regenerates a figure or table of its paper (PNG + JSON) into
``experiments/results/``."""
