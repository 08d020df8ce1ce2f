"""What a person sees: matplotlib figures, offline CircuitsVis views, the HTML report.

Place in the seams: the floor under the command line; it may import everything below it, and
nothing below imports it. matplotlib and circuitsvis are imported when something is drawn.

* :mod:`~equivariance_probe.display.figures` — the study's figures.
* :mod:`~equivariance_probe.display.views` — CircuitsVis views of heads on one document
  (:mod:`~equivariance_probe.display.circuitsvis`: the bundle, offline), and
  :mod:`~equivariance_probe.display.overview`: a long window's heads in blocks of positions, on canvases.
* :mod:`~equivariance_probe.display.report` — the report as a list of sections.
* :mod:`~equivariance_probe.display.comparison`, :mod:`~equivariance_probe.display.scan` and
  :mod:`~equivariance_probe.display.positional` — the comparison's figure, the context-length scan's
  figure, the positional analyses' figures and section.
"""
