/* The nonzero returns that the LoRA kernel and the MoE kernels share (lora/sgmv.h, workers/models/moe_gemm.h). */
#ifndef LORASERVE_STATUS_H
#define LORASERVE_STATUS_H
enum { OUT_OF_MEMORY = 1, OUT_OF_RANGE = 2 };
#endif
