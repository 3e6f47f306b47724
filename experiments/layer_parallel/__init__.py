"""The layer-parallel seed's experiments (Günther et al., seed 003):

* :mod:`.convergence` — Fig. 4, MGRIT residual histories against depth;
* :mod:`.scaling` — Table 1 / Fig. 5, weak scaling measured and modelled;
* :mod:`.training` — Table 2 / Fig. 7, layer-serial against simultaneous
  layer-parallel training on Peaks.
"""
