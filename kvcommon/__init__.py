"""What the scenarios, the codecs, the harness and the statistics share and none of them owns:
seeded random streams (rng), rotary position embedding (rope), scoped single-threading of
small linear algebra (threads), the registry type (registry), the columns of a stored trial
row (rows), and the switch, gate and thread split of the compiled CPU loops (compiled) with
torch's orders of a norm's sum of squares and of a row's sum for them (vector_norm_cpu, sum_cpu:
numba, imported only where a computation takes the loops). Importing it loads no codec."""
