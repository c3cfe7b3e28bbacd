"""What the scenarios, the codecs, the harness and the statistics share and none of them owns:
seeded random streams (rng), rotary position embedding (rope), scoped single-threading of
small linear algebra (threads), the registry type (registry) and the columns of a stored trial
row (rows). Importing it loads no codec."""
