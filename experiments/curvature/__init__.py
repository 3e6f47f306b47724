"""BackPACK's experiments (seed 001) with :mod:`chainerkfac.curvature`:
the overhead of each quantity (Fig. 6) and the damped curvature updates on
the digits data (Fig. 7)."""
