// LD_PRELOAD shim: refuses the AMX tile-data permission request (arch_prctl ARCH_REQ_XCOMP_PERM), so that a program
// which asks before using AMX (ggml does) falls back to its other kernels. Every other syscall() passes through.
// The benchmark VM faults on AMX tile instructions, which a native llama.cpp build uses (docs/quant-kernels.md):
//   gcc -O2 -shared -fPIC -o /tmp/noamx.so bench/noamx.c -ldl
//   LD_PRELOAD=/tmp/noamx.so kvcmas bench core --compare llama-cpp ...
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>

long syscall(long number, ...) {
    va_list ap;
    va_start(ap, number);
    long a[6];
    for (int i = 0; i < 6; ++i) a[i] = va_arg(ap, long);
    va_end(ap);
    if (number == SYS_arch_prctl && a[0] == 0x1023) {  // ARCH_REQ_XCOMP_PERM
        errno = EPERM;
        return -1;
    }
    static long (*real)(long, ...) = 0;
    if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
