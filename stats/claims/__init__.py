"""The AMD paper's claims (*Ablation Studies, Statistical Inference, and KV-Cache Compression
Validation*, D'Alberto, Sirasao, Delaye, Patwari; cited by section) as falsifiable tests on stored
trial rows: `harness reproduce amd-paper` runs the sweeps, this package judges them.

framework.py is the verdict rule every claim follows (one comparison, its outcome, a claim's
verdict and reason, the claims table); paper.py states the claims and the paper's figures; each
other module judges one claim (claims 2 and 3, and 5 and 12, share one). The names below are the
package's interface: `from stats import claims as C; C.claim_jensen(...)`.
"""
from ..margins import ALPHA
from .d_eff import RANK_MARGIN, claim_d_eff
from .framework import (CLAIM_COLUMNS, METRIC, N_BOOT, OUTCOMES, SCOPES, STORAGE_SLACK, TEST_COLUMNS, VERDICTS,
                        ClaimResult,
                        claims_frame, format_claims, lacking, paired_row, tests_frame, unpaired_row)
from .heavy_tail import claim_heavy_tail
from .non_dominated import claim_non_dominated
from .paper import (CLAIMS, ELIMINATED, FULL_VS_RHT, PAPER_BITS_PER_TOKEN, PAPER_D_EFF, PAPER_DIM, SQ_CODECS,
                    STORAGE_CODECS, STRUCTURED, SURVIVORS, TAIL_BITS, TQ_VARIANTS, V_QJL, Claim, paper_storage)
from .plain_degrades import DEGRADE_MARGIN, claim_plain_degrades
from .separable import claim_separable
from .softmax_paths import V_FLAT_MARGIN, claim_jensen, claim_v_path, first_order_t_rel_mse, path_slopes
from .sq_wins import claim_sq_wins
from .squ_equal_storage import claim_equal_storage
from .storage_figures import claim_storage_figures
from .waterfill import CODEC_MARGIN, WATERFILL_MARGIN, claim_waterfill_uniform
from .worse_pairs import claim_full_worse, claim_v_qjl_hurts

__all__ = [
    "ALPHA", "CLAIMS", "CLAIM_COLUMNS", "CODEC_MARGIN", "DEGRADE_MARGIN", "ELIMINATED", "FULL_VS_RHT", "METRIC", "N_BOOT", "OUTCOMES",
    "PAPER_BITS_PER_TOKEN", "PAPER_DIM", "PAPER_D_EFF", "RANK_MARGIN", "SCOPES", "SQ_CODECS", "STORAGE_CODECS", "STORAGE_SLACK",
    "STRUCTURED", "SURVIVORS", "TAIL_BITS", "TEST_COLUMNS", "TQ_VARIANTS", "VERDICTS", "V_FLAT_MARGIN", "V_QJL",
    "WATERFILL_MARGIN", "Claim", "ClaimResult", "claim_d_eff", "claim_equal_storage", "claim_full_worse",
    "claim_heavy_tail", "claim_jensen", "claim_non_dominated", "claim_plain_degrades", "claim_separable",
    "claim_sq_wins", "claim_storage_figures", "claim_v_path", "claim_v_qjl_hurts", "claim_waterfill_uniform",
    "claims_frame", "first_order_t_rel_mse", "format_claims", "lacking", "paired_row", "paper_storage", "path_slopes",
    "tests_frame", "unpaired_row",
]
