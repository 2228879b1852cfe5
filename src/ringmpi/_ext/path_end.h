/* the end of one vector path's headers (exp_rows.h, block_rows.h): its macros undefined */
#undef FN
#undef VF
#undef VI
#undef VU
#undef LOAD
#undef STORE
#undef NVEC
#undef PINLINE
#undef CAT
#undef CAT_
#undef PATH
#undef PATH_ISA
#undef VW
#undef NB
