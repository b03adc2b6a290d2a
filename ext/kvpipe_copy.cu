// kvpipe_copy.cu - move KV-cache blocks between a paged device cache and block-major staging.
//
// Compiled at run time by NVRTC (kvpipe/cuda/_nvrtc.py) with
//   -std=c++17 -Werror=all-warnings --gpu-architecture=sm_XY
// and kept on disk keyed by source hash, architecture and NVRTC version.
//
// Layout. A cache is one tensor per (layer, role) ("segment"), each [num_blocks, seg.nbytes]
// bytes. A staging slot holds one stored block value: every segment's block back to back at
// seg.offset (contract order), then a trailer the host writes. The launch gets:
//   segs   device array of KvSegment, one per (layer, role) - the pointer table
//   pairs  device array of (cache block, staging slot) int64 pairs - the slice
//   staging  device-visible address of slot 0 (mapped pinned staging, or a device scratch
//            buffer), slots `stride` bytes apart
// Grid: x = pair * n_seg + seg (block-major: consecutive CTAs fill one staging slot),
//       y = chunk of `chunk_bytes` inside a segment's block. Threads stride over the chunk.
//
// Copies use the widest unit (16, 8, 4, 2 or 1 bytes) at which source and destination are
// mutually aligned: a scalar head up to the first aligned address, aligned vector units, then
// a scalar tail. Every byte of every size is copied (FastDeploy's swap kernel dropped the
// tail of blocks whose size is not a multiple of 16 bytes).
//
// With -DKVPIPE_HOST_EMULATION the same code compiles as host C++: the tests run every CTA
// and thread sequentially on the CPU (threads of a CTA are independent: no shared memory, no
// barriers) and count vector accesses that would be misaligned on a GPU.

#ifdef KVPIPE_HOST_EMULATION
#define KVPIPE_DEVICE static inline
#define KVPIPE_RESTRICT __restrict__
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned int x, y;
};
static unsigned long long kvpipe_emu_misaligned = 0;
#define KVPIPE_CHECK_ALIGNED(p, width)                                                  \
    do {                                                                                \
        if (reinterpret_cast<unsigned long long>(p) % (width) != 0) kvpipe_emu_misaligned++; \
    } while (0)
#else
#define KVPIPE_DEVICE __device__ __forceinline__
#define KVPIPE_RESTRICT __restrict__
#define KVPIPE_CHECK_ALIGNED(p, width) \
    do {                               \
    } while (0)
#endif

// One (layer, role) tensor: where its blocks live and where they go in a staging slot.
struct KvSegment {
    unsigned long long base;    // address of block 0 of the tensor
    unsigned long long offset;  // byte offset of this tensor's block inside a staging slot
    unsigned long long nbytes;  // bytes of one block of this tensor
};

template <typename T>
KVPIPE_DEVICE void kvpipe_copy_units(unsigned char* dst, const unsigned char* src,
                                     unsigned long long units, unsigned int tid,
                                     unsigned int nthreads) {
    T* d = reinterpret_cast<T*>(dst);
    const T* s = reinterpret_cast<const T*>(src);
    for (unsigned long long i = tid; i < units; i += nthreads) {
        KVPIPE_CHECK_ALIGNED(d + i, sizeof(T));
        KVPIPE_CHECK_ALIGNED(s + i, sizeof(T));
        d[i] = s[i];
    }
}

// Copy n bytes; the calling thread is `tid` of `nthreads`. Any n, any alignment.
KVPIPE_DEVICE void kvpipe_copy_bytes(unsigned char* dst, const unsigned char* src,
                                     unsigned long long n, unsigned int tid,
                                     unsigned int nthreads) {
    const unsigned long long s = reinterpret_cast<unsigned long long>(src);
    const unsigned long long d = reinterpret_cast<unsigned long long>(dst);
    const unsigned long long mis = s ^ d;
    const unsigned long long width = (mis & 15ull) == 0   ? 16ull
                                     : (mis & 7ull) == 0  ? 8ull
                                     : (mis & 3ull) == 0  ? 4ull
                                     : (mis & 1ull) == 0  ? 2ull
                                                          : 1ull;
    unsigned long long head = (width - (s & (width - 1ull))) & (width - 1ull);
    if (head > n) {
        head = n;
    }
    const unsigned long long units = (n - head) / width;
    const unsigned long long body_end = head + units * width;
    for (unsigned long long i = tid; i < head; i += nthreads) {
        dst[i] = src[i];
    }
    switch (width) {
        case 16ull:
            kvpipe_copy_units<uint4>(dst + head, src + head, units, tid, nthreads);
            break;
        case 8ull:
            kvpipe_copy_units<uint2>(dst + head, src + head, units, tid, nthreads);
            break;
        case 4ull:
            kvpipe_copy_units<unsigned int>(dst + head, src + head, units, tid, nthreads);
            break;
        case 2ull:
            kvpipe_copy_units<unsigned short>(dst + head, src + head, units, tid, nthreads);
            break;
        default:
            kvpipe_copy_units<unsigned char>(dst + head, src + head, units, tid, nthreads);
            break;
    }
    for (unsigned long long i = body_end + tid; i < n; i += nthreads) {
        dst[i] = src[i];
    }
}

// The work of one CTA (bx, by) for thread tid: one chunk of one segment of one pair.
KVPIPE_DEVICE void kvpipe_copy_cta(bool to_staging, const KvSegment* KVPIPE_RESTRICT segs,
                                   int n_seg, const long long* KVPIPE_RESTRICT pairs,
                                   long long n_pairs, unsigned char* staging,
                                   unsigned long long stride, unsigned long long chunk_bytes,
                                   unsigned long long bx, unsigned long long by,
                                   unsigned int tid, unsigned int nthreads) {
    if (n_seg <= 0) {
        return;
    }
    const unsigned long long nseg = static_cast<unsigned long long>(n_seg);
    const long long pair = static_cast<long long>(bx / nseg);
    const unsigned long long seg = bx % nseg;
    if (pair >= n_pairs) {
        return;
    }
    const KvSegment sg = segs[seg];
    const unsigned long long lo = by * chunk_bytes;
    if (lo >= sg.nbytes) {
        return;
    }
    const unsigned long long rest = sg.nbytes - lo;
    const unsigned long long n = rest < chunk_bytes ? rest : chunk_bytes;
    const unsigned long long block = static_cast<unsigned long long>(pairs[2 * pair]);
    const unsigned long long slot = static_cast<unsigned long long>(pairs[2 * pair + 1]);
    unsigned char* cache = reinterpret_cast<unsigned char*>(sg.base + block * sg.nbytes + lo);
    unsigned char* stage = staging + slot * stride + sg.offset + lo;
    if (to_staging) {
        kvpipe_copy_bytes(stage, cache, n, tid, nthreads);
    } else {
        kvpipe_copy_bytes(cache, stage, n, tid, nthreads);
    }
}

#ifndef KVPIPE_HOST_EMULATION

// Cache blocks -> staging slots (device -> host when `staging` is mapped pinned memory).
extern "C" __global__ void __launch_bounds__(256)
    kvpipe_gather_blocks(const KvSegment* KVPIPE_RESTRICT segs, int n_seg,
                         const long long* KVPIPE_RESTRICT pairs, long long n_pairs,
                         unsigned char* staging, unsigned long long stride,
                         unsigned long long chunk_bytes) {
    kvpipe_copy_cta(true, segs, n_seg, pairs, n_pairs, staging, stride, chunk_bytes, blockIdx.x,
                    blockIdx.y, threadIdx.x, blockDim.x);
}

// Staging slots -> cache blocks.
extern "C" __global__ void __launch_bounds__(256)
    kvpipe_scatter_blocks(const KvSegment* KVPIPE_RESTRICT segs, int n_seg,
                          const long long* KVPIPE_RESTRICT pairs, long long n_pairs,
                          unsigned char* staging, unsigned long long stride,
                          unsigned long long chunk_bytes) {
    kvpipe_copy_cta(false, segs, n_seg, pairs, n_pairs, staging, stride, chunk_bytes, blockIdx.x,
                    blockIdx.y, threadIdx.x, blockDim.x);
}

#else

// Host emulation: run the whole grid sequentially; returns misaligned vector accesses seen.
extern "C" unsigned long long kvpipe_emulate(int to_staging, const KvSegment* segs, int n_seg,
                                             const long long* pairs, long long n_pairs,
                                             unsigned char* staging, unsigned long long stride,
                                             unsigned long long chunk_bytes,
                                             unsigned long long grid_x,
                                             unsigned long long grid_y,
                                             unsigned int block_x) {
    kvpipe_emu_misaligned = 0;
    for (unsigned long long bx = 0; bx < grid_x; ++bx) {
        for (unsigned long long by = 0; by < grid_y; ++by) {
            for (unsigned int tid = 0; tid < block_x; ++tid) {
                kvpipe_copy_cta(to_staging != 0, segs, n_seg, pairs, n_pairs, staging, stride,
                                chunk_bytes, bx, by, tid, block_x);
            }
        }
    }
    return kvpipe_emu_misaligned;
}

#endif
