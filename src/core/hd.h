// MC_HD marks functions that compile for host and device alike (plain host
// functions where nvcc is not the compiler), so one definition serves the
// host code and the kernels.
#pragma once

#if defined(__CUDACC__)
#define MC_HD __host__ __device__
#else
#define MC_HD
#endif
