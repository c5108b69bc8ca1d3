/* cpuid_avx2.c: make every library in a process see an AVX2-only x86-64 CPU (LD_PRELOAD shim).
 *
 * Why: ONNX Runtime's MLAS, MKL, oneDNN and ATen pick their kernels from the `cpuid` instruction
 * (and XCR0 via `xgetbv`), and MLAS has no switch to hold it to AVX2. On a CPU and kernel with
 * CPUID faulting (`cpuid_fault` in /proc/cpuinfo), arch_prctl(ARCH_SET_CPUID, 0) makes `cpuid` raise
 * SIGSEGV in this thread (and in every thread or child created later; execve resets it, and this
 * constructor runs again in the new image because LD_PRELOAD is inherited). The SIGSEGV handler below
 * runs the real `cpuid`, clears the AVX-512 / AMX / AVX-VNNI / ... bits, and resumes after the
 * instruction. Libraries test "cpuid bit AND the XCR0 state bits" before using AVX-512 or AMX, so a
 * cleared cpuid bit is enough; XCR0 (xgetbv cannot be trapped) and cpuid leaf 0xD (XSAVE sizes) are left
 * true, so XSAVE buffers stay the right size. Only the ISA is emulated: caches, cores and frequencies
 * remain this CPU's.
 *
 * Faults that are not `cpuid` go to whatever SIGSEGV handler the program installed (sigaction/signal
 * are interposed: a handler installed later, e.g. Python's faulthandler, is chained, not allowed to
 * replace this one), else to the default action: a real crash still kills the process with SIGSEGV.
 *
 * Build: gcc -O2 -shared -fPIC -o cpuid_avx2.so cpuid_avx2.c -ldl   (benchmarks/_isa.py does this)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define ARCH_GET_CPUID 0x1011
#define ARCH_SET_CPUID 0x1012
#define BIT(n) (1u << (n))

/* Leaf 7 subleaf 0. EBX: avx512f 16, dq 17, ifma 21, pf 26, er 27, cd 28, bw 30, vl 31. */
static const uint32_t L7_0_EBX = BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31);
/* ECX: avx512_vbmi 1, avx512_vbmi2 6, avx512_vnni 11, avx512_bitalg 12, avx512_vpopcntdq 14. */
static const uint32_t L7_0_ECX = BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14);
/* EDX: avx512_4vnniw 2, avx512_4fmaps 3, avx512_vp2intersect 8, amx_bf16 22, avx512_fp16 23,
 * amx_tile 24, amx_int8 25. */
static const uint32_t L7_0_EDX = BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25);
/* Leaf 7 subleaf 1. EAX: avx_vnni 4, avx512_bf16 5, amx_fp16 21, avx_ifma 23 (VEX extensions no
 * AVX2-generation CPU has). EDX: avx_vnni_int8 4, avx_ne_convert 5, amx_complex 8, avx10 19. */
static const uint32_t L7_1_EAX = BIT(4) | BIT(5) | BIT(21) | BIT(23);
static const uint32_t L7_1_EDX = BIT(4) | BIT(5) | BIT(8) | BIT(19);

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);
static sigaction_fn real_sigaction;
static struct sigaction chained; /* what the program believes is its SIGSEGV handler (SIG_DFL at start) */
static volatile sig_atomic_t active;

static long set_cpuid(int enabled) { return syscall(SYS_arch_prctl, ARCH_SET_CPUID, enabled); }

static void mask(uint32_t leaf, uint32_t subleaf, uint32_t r[4]) {
    if (leaf == 7 && subleaf == 0) {
        r[1] &= ~L7_0_EBX;
        r[2] &= ~L7_0_ECX;
        r[3] &= ~L7_0_EDX;
    } else if (leaf == 7 && subleaf == 1) {
        r[0] &= ~L7_1_EAX;
        r[3] &= ~L7_1_EDX;
    }
}

/* Hand a fault that is not ours to the program's handler, or die of it as without this shim. */
static void pass_on(int sig, siginfo_t *info, void *context) {
    struct sigaction next = chained;
    if (next.sa_flags & SA_RESETHAND) chained.sa_handler = SIG_DFL;
    if (next.sa_flags & SA_SIGINFO) {
        next.sa_sigaction(sig, info, context);
    } else if (next.sa_handler != SIG_DFL && next.sa_handler != SIG_IGN) {
        next.sa_handler(sig);
    } else if (next.sa_handler == SIG_DFL || info->si_code > 0) {
        /* Default action: a faulting instruction faults again on return and kills the process; a
         * signal sent by kill/raise (si_code <= 0) is raised again and delivered on return. */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        real_sigaction(SIGSEGV, &dfl, NULL);
        if (info->si_code <= 0) raise(sig);
    } /* else: SIG_IGN of a sent signal: ignored, as the program asked */
}

static void on_segv(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = context;
    greg_t *g = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)g[REG_RIP];
    /* A faulting cpuid is a general-protection fault (si_code SI_KERNEL) with RIP on its 0F A2 opcode.
     * A #GP leaves RIP on an instruction that was fetched, so reading two bytes there is safe (a jump to
     * an unmapped address is SEGV_MAPERR instead and never reads RIP). */
    if (info->si_code == SI_KERNEL && ip[0] == 0x0F && ip[1] == 0xA2) {
        int saved_errno = errno;
        uint32_t r[4], leaf = (uint32_t)g[REG_RAX], subleaf = (uint32_t)g[REG_RCX];
        set_cpuid(1);
        __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(subleaf));
        set_cpuid(0);
        mask(leaf, subleaf, r);
        /* cpuid writes the low 32 bits and zeroes the high 32 bits of each register. */
        g[REG_RAX] = r[0];
        g[REG_RBX] = r[1];
        g[REG_RCX] = r[2];
        g[REG_RDX] = r[3];
        g[REG_RIP] += 2;
        errno = saved_errno;
        return;
    }
    pass_on(sig, info, context);
}

/* Interposed: SIGSEGV handlers installed by the program are recorded and chained (see pass_on), ours
 * stays installed. Other signals go straight to libc. */
int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (!real_sigaction) real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
    if (sig != SIGSEGV || !active) return real_sigaction(sig, act, old);
    if (old) *old = chained;
    if (act) chained = *act;
    return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
    struct sigaction act, old;
    memset(&act, 0, sizeof act);
    act.sa_handler = handler;
    act.sa_flags = SA_RESTART;
    sigemptyset(&act.sa_mask);
    if (sigaction(sig, &act, &old) != 0) return SIG_ERR;
    return old.sa_handler;
}

/* 1 while the mask is in force: lets a program (benchmarks/_isa.py) tell that it runs under the shim. */
int cpuid_avx2_active(void) { return active; }

__attribute__((constructor(101))) static void install(void) {
    struct sigaction act;
    real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
    memset(&act, 0, sizeof act);
    act.sa_sigaction = on_segv;
    act.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&act.sa_mask);
    if (!real_sigaction || real_sigaction(SIGSEGV, &act, &chained) != 0) {
        fprintf(stderr, "cpuid_avx2: cannot install the SIGSEGV handler; refusing to run unmasked\n");
        _exit(70);
    }
    if (set_cpuid(0) != 0) {
        fprintf(stderr,
                "cpuid_avx2: CPUID faulting is not available here (arch_prctl(ARCH_SET_CPUID, 0): %s); this "
                "CPU/kernel cannot emulate an AVX2 host (needs the cpuid_fault flag in /proc/cpuinfo); refusing "
                "to run with the host's real ISA\n",
                strerror(errno));
        _exit(70);
    }
    active = 1;
}
