"""bench/probes/fp8_attention_sass.py's loop finder on a hand-written SASS listing (no GPU, no
compiler): the main loop is the shortest backward branch whose body holds both MMAs; a longer
wait loop that branches back into it, and a loop without both MMAs, are not it."""
from bench.probes.fp8_attention_sass import main_loop

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   IGMMA.64x128x32.S8.S8 R24, gdesc[UR4], R24 ;
        /*0020*/                   FFMA R2, R3, R4, R5 ;
        /*0030*/                   MUFU.EX2 R2, R2 ;
        /*0040*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, R152, gdesc[UR8], R88 ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   FADD R6, R6, R7 ;
        /*0070*/              @!P1 BRA `(.L_x_2) ;
        /*0080*/                   EXIT ;
        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR13], R23 ;
        /*00a0*/              @!P0 BRA `(.L_x_1) ;
"""


def test_the_main_loop_is_the_shortest_body_with_both_mmas():
    loop = main_loop(SASS)
    assert [op.split(".")[0] for op in loop] == ["IGMMA", "FFMA", "MUFU", "QGMMA", "BRA"]


def test_no_loop_with_both_mmas_gives_nothing():
    assert main_loop(SASS.replace("QGMMA", "HGMMA")) == []
