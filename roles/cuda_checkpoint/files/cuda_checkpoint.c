/*
 * gpuckpt-cuda-checkpoint: a cuda-checkpoint compatible tool of gpuckpt.fleet's own.
 *
 * It calls the same driver entry points as the engine (plugins/module_utils/driver.py), the CUDA
 * driver's checkpoint API of driver 570+ (CUDA 12.8), through libcuda.so.1 opened at run time:
 *
 *   --get-state       --pid P              prints running|locked|checkpointed|failed
 *   --action lock     --pid P [--timeout MS]
 *   --action checkpoint|unlock --pid P
 *   --action restore  --pid P [--device-map OLD=NEW[,OLD=NEW...]]   (other GPUs: driver 580+)
 *   --toggle          --pid P [--timeout MS] [--device-map ...]   running -> checkpointed -> running
 *   --get-restore-tid --pid P              prints the driver's restore thread id
 *   --version | --help
 *
 * The command line is NVIDIA's (CRIU's cuda plugin execs it by that name and reads `-h` for
 * "--action"), so either binary serves the collection. It exists because NVIDIA's binary cannot be
 * fetched everywhere, and because a gVisor sandbox hides its processes from the host: there the CUDA
 * stage must run INSIDE the sandbox (runsc exec), with the sandbox's pids, on the container's own libc.
 *
 * Why the odd start-up code: a binary linked on glibc 2.34 or newer needs GLIBC_2.34 at run time
 * (__libc_start_main and dlopen moved into libc.so.6 there), which CUDA images on Ubuntu 20.04 or
 * RHEL 8 do not have. On x86_64 this file names the oldest versions of the few glibc symbols it uses
 * and brings its own _start (build.sh links it with -nostartfiles), so the same binary runs on every
 * glibc that the NVIDIA driver itself supports. Elsewhere it is an ordinary program, built where it runs.
 *
 * Exit status: 0 done; 1 the driver refused (stderr: "... CUDA_ERROR_NAME (code)"); 2 bad usage;
 * 3 no usable driver (libcuda.so.1 missing, or older than 570). GPUCKPT_LIBCUDA names another library
 * (the CI's test double).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOOL_VERSION "0.1.0"

#if defined(GPUCKPT_OLD_GLIBC) && defined(__x86_64__)
/* Bind each libc symbol to its oldest version (GLIBC_2.2.5 is x86_64's first): see the header comment. */
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
__asm__(".symver dlerror,dlerror@GLIBC_2.2.5");
__asm__(".symver __libc_start_main,__libc_start_main@GLIBC_2.2.5");
/* The program's entry, as glibc's crt1.o has it: argc and argv from the stack, rtld_fini in rdx;
 * no init/fini functions (this program has no constructors). */
__asm__(".text\n.globl _start\n.type _start,@function\n_start:\n"
        "  xor %ebp, %ebp\n  mov %rdx, %r9\n  pop %rsi\n  mov %rsp, %rdx\n  and $-16, %rsp\n"
        "  push %rax\n  push %rsp\n  xor %r8d, %r8d\n  xor %ecx, %ecx\n"
        "  lea main(%rip), %rdi\n  call *__libc_start_main@GOTPCREL(%rip)\n  hlt\n");
#endif

enum { EXIT_DRIVER = 1, EXIT_USAGE = 2, EXIT_NO_DRIVER = 3 };
enum { ST_RUNNING = 0, ST_LOCKED = 1, ST_CHECKPOINTED = 2, ST_FAILED = 3 };
#define MIN_API_VERSION 12080   /* CUDA 12.8, driver 570: the first with the checkpoint API */
#define REMAP_API_VERSION 13000 /* CUDA 13.0, driver 580: restore onto other GPUs */
#define MAX_PAIRS 64

/* The driver's argument structs (64 bytes each, cuda.h of CUDA 13). */
typedef struct { unsigned int timeoutMs; unsigned int reserved0; uint64_t reserved1[7]; } LockArgs;
typedef struct { unsigned char bytes[16]; } Uuid;
typedef struct { Uuid oldUuid; Uuid newUuid; } GpuPair;
typedef struct { GpuPair *gpuPairs; unsigned int gpuPairsCount; char reserved[44]; uint64_t reserved1; } RestoreArgs;
typedef char lock_args_is_64_bytes[sizeof(LockArgs) == 64 ? 1 : -1];
typedef char restore_args_is_64_bytes[sizeof(RestoreArgs) == 64 ? 1 : -1];

typedef int (*fn_init)(unsigned int);
typedef int (*fn_version)(int *);
typedef int (*fn_error_name)(int, const char **);
typedef int (*fn_pid_int)(int, int *);
typedef int (*fn_pid_args)(int, void *);

static struct {
    fn_init init;
    fn_version version;
    fn_error_name error_name;
    fn_pid_int get_state, get_restore_tid;
    fn_pid_args lock, checkpoint, restore, unlock;
} cu;

static const char *state_name(int s) {
    switch (s) {
    case ST_RUNNING: return "running";
    case ST_LOCKED: return "locked";
    case ST_CHECKPOINTED: return "checkpointed";
    case ST_FAILED: return "failed";
    default: return "unknown";
    }
}

static void usage(FILE *out) {
    fprintf(out,
            "Usage: gpuckpt-cuda-checkpoint [--toggle | --get-state | --get-restore-tid | --action ACTION] --pid PID\n"
            "                               [--timeout MS] [--device-map OLD=NEW[,OLD=NEW...]]\n"
            "  --action ACTION      lock, checkpoint, restore or unlock\n"
            "  --toggle             a running process: lock + checkpoint; a checkpointed one: restore + unlock\n"
            "  --get-state          print running, locked, checkpointed or failed\n"
            "  --get-restore-tid    print the driver's restore thread id\n"
            "  --pid PID            the CUDA process (a pid of this tool's pid namespace)\n"
            "  --timeout MS         how long lock waits for running CUDA work (0: the driver's default)\n"
            "  --device-map MAP     restore onto other GPUs: OLD=NEW pairs of GPU UUIDs naming every GPU\n"
            "                       visible to the process (driver 580+); ':' may stand for '='\n"
            "  --version, -h, --help\n"
            "Environment: GPUCKPT_LIBCUDA, the driver library to open (default libcuda.so.1).\n");
}

static const char *error_name(int code) {
    const char *name = NULL;
    if (cu.error_name && cu.error_name(code, &name) == 0 && name) return name;
    return "CUDA_ERROR";
}

static int check(const char *call, int pid, int rc) {
    if (rc != 0) {
        fprintf(stderr, "gpuckpt-cuda-checkpoint: %s failed for pid %d: %s (%d)\n", call, pid, error_name(rc), rc);
        return EXIT_DRIVER;
    }
    return 0;
}

static void *need(void *lib, const char *sym, int *missing) {
    void *p = dlsym(lib, sym);
    if (!p) {
        fprintf(stderr, "gpuckpt-cuda-checkpoint: the driver library has no %s: it is older than 570 and lacks "
                        "the checkpoint API\n", sym);
        *missing = 1;
    }
    return p;
}

static int load_driver(int *api_version) {
    const char *path = getenv("GPUCKPT_LIBCUDA");
    if (!path || !*path) path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "gpuckpt-cuda-checkpoint: cannot load the NVIDIA driver library %s: %s\n", path, dlerror());
        return EXIT_NO_DRIVER;
    }
    int missing = 0;
    cu.init = (fn_init)need(lib, "cuInit", &missing);
    cu.version = (fn_version)need(lib, "cuDriverGetVersion", &missing);
    cu.error_name = (fn_error_name)dlsym(lib, "cuGetErrorName");
    cu.get_state = (fn_pid_int)need(lib, "cuCheckpointProcessGetState", &missing);
    cu.get_restore_tid = (fn_pid_int)need(lib, "cuCheckpointProcessGetRestoreThreadId", &missing);
    cu.lock = (fn_pid_args)need(lib, "cuCheckpointProcessLock", &missing);
    cu.checkpoint = (fn_pid_args)need(lib, "cuCheckpointProcessCheckpoint", &missing);
    cu.restore = (fn_pid_args)need(lib, "cuCheckpointProcessRestore", &missing);
    cu.unlock = (fn_pid_args)need(lib, "cuCheckpointProcessUnlock", &missing);
    if (missing) return EXIT_NO_DRIVER;
    /* cuInit must have run in the calling process before the checkpoint calls work; its own failure
     * (no GPU visible to this process) does not stop them. */
    (void)cu.init(0);
    *api_version = 0;
    if (cu.version(api_version) == 0 && *api_version > 0 && *api_version < MIN_API_VERSION) {
        fprintf(stderr, "gpuckpt-cuda-checkpoint: the driver reports CUDA API %d.%d, older than 12.8 (driver 570), "
                        "the first with the checkpoint API\n", *api_version / 1000, (*api_version % 1000) / 10);
        return EXIT_NO_DRIVER;
    }
    return 0;
}

static int parse_pid(const char *s, int *pid) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v <= 0 || v > INT_MAX) return -1;
    *pid = (int)v;
    return 0;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (or the bare 32 hex digits) -> 16 bytes. */
static int parse_uuid(const char *s, size_t len, Uuid *out) {
    if (len >= 4 && strncasecmp(s, "GPU-", 4) == 0) { s += 4; len -= 4; }
    int n = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] == '-') continue;
        int hi = hexval(s[i]);
        if (hi < 0 || i + 1 >= len) return -1;
        int lo = hexval(s[++i]);
        if (lo < 0 || n >= 16) return -1;
        out->bytes[n++] = (unsigned char)(hi << 4 | lo);
    }
    return n == 16 ? 0 : -1;
}

static int parse_device_map(const char *map, GpuPair *pairs, unsigned int *count) {
    *count = 0;
    const char *p = map;
    while (*p) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        const char *sep = memchr(p, '=', len);
        if (!sep) sep = memchr(p, ':', len);
        if (!sep || *count >= MAX_PAIRS || parse_uuid(p, (size_t)(sep - p), &pairs[*count].oldUuid) ||
            parse_uuid(sep + 1, len - (size_t)(sep - p) - 1, &pairs[*count].newUuid)) {
            fprintf(stderr, "gpuckpt-cuda-checkpoint: bad --device-map entry '%.*s' (want GPU-<uuid>=GPU-<uuid>)\n",
                    (int)len, p);
            return -1;
        }
        (*count)++;
        p += len;
        if (*p == ',') p++;
    }
    return *count ? 0 : -1;
}

static int do_restore(int pid, GpuPair *pairs, unsigned int npairs, int api_version) {
    if (!npairs) return check("cuCheckpointProcessRestore", pid, cu.restore(pid, NULL));
    if (api_version < REMAP_API_VERSION) {
        fprintf(stderr, "gpuckpt-cuda-checkpoint: restoring onto other GPUs needs driver 580+ (CUDA 13.0); this "
                        "driver reports CUDA %d.%d\n", api_version / 1000, (api_version % 1000) / 10);
        return EXIT_NO_DRIVER;
    }
    RestoreArgs args;
    memset(&args, 0, sizeof args);
    args.gpuPairs = pairs;
    args.gpuPairsCount = npairs;
    return check("cuCheckpointProcessRestore", pid, cu.restore(pid, &args));
}

static int do_lock(int pid, unsigned int timeout_ms) {
    LockArgs args;
    memset(&args, 0, sizeof args);
    args.timeoutMs = timeout_ms;
    return check("cuCheckpointProcessLock", pid, cu.lock(pid, &args));
}

int main(int argc, char **argv) {
    const char *action = NULL, *device_map = NULL;
    int pid = 0, toggle = 0, get_state = 0, get_tid = 0;
    unsigned long timeout_ms = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = (i + 1 < argc) ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        if (!strcmp(a, "--version")) { printf("gpuckpt-cuda-checkpoint %s\n", TOOL_VERSION); return 0; }
        if (!strcmp(a, "--toggle")) { toggle = 1; continue; }
        if (!strcmp(a, "--get-state")) { get_state = 1; continue; }
        if (!strcmp(a, "--get-restore-tid")) { get_tid = 1; continue; }
        int takes_value = !strcmp(a, "--pid") || !strcmp(a, "-p") || !strcmp(a, "--action") ||
                          !strcmp(a, "--timeout") || !strcmp(a, "--device-map");
        if (!takes_value) {
            fprintf(stderr, "gpuckpt-cuda-checkpoint: unknown option %s\n", a);
            usage(stderr);
            return EXIT_USAGE;
        }
        if (!val) { fprintf(stderr, "gpuckpt-cuda-checkpoint: %s needs a value\n", a); usage(stderr); return EXIT_USAGE; }
        i++;
        if (!strcmp(a, "--pid") || !strcmp(a, "-p")) {
            if (parse_pid(val, &pid)) { fprintf(stderr, "gpuckpt-cuda-checkpoint: bad pid '%s'\n", val); return EXIT_USAGE; }
        } else if (!strcmp(a, "--action")) {
            action = val;
        } else if (!strcmp(a, "--timeout")) {
            char *end;
            errno = 0;
            timeout_ms = strtoul(val, &end, 10);
            if (errno || end == val || *end || timeout_ms > UINT32_MAX) {
                fprintf(stderr, "gpuckpt-cuda-checkpoint: bad timeout '%s' (milliseconds)\n", val);
                return EXIT_USAGE;
            }
        } else {
            device_map = val;
        }
    }
    if (toggle + get_state + get_tid + (action != NULL) != 1 || !pid) {
        fprintf(stderr, "gpuckpt-cuda-checkpoint: give exactly one of --toggle, --get-state, --get-restore-tid, "
                        "--action, and --pid\n");
        usage(stderr);
        return EXIT_USAGE;
    }
    if (action && strcmp(action, "lock") && strcmp(action, "checkpoint") && strcmp(action, "restore") &&
        strcmp(action, "unlock")) {
        fprintf(stderr, "gpuckpt-cuda-checkpoint: unknown action '%s' (lock, checkpoint, restore, unlock)\n", action);
        return EXIT_USAGE;
    }
    static GpuPair pairs[MAX_PAIRS];
    unsigned int npairs = 0;
    if (device_map) {
        if (!(toggle || (action && !strcmp(action, "restore")))) {
            fprintf(stderr, "gpuckpt-cuda-checkpoint: --device-map goes with --action restore or --toggle\n");
            return EXIT_USAGE;
        }
        if (parse_device_map(device_map, pairs, &npairs)) return EXIT_USAGE;
    }
    int api_version = 0;
    int rc = load_driver(&api_version);
    if (rc) return rc;

    if (get_state || toggle) {
        int st = -1;
        rc = check("cuCheckpointProcessGetState", pid, cu.get_state(pid, &st));
        if (rc) return rc;
        if (get_state) { printf("%s\n", state_name(st)); return 0; }
        if (st == ST_RUNNING) {
            rc = do_lock(pid, (unsigned int)timeout_ms);
            if (rc) return rc;
            rc = check("cuCheckpointProcessCheckpoint", pid, cu.checkpoint(pid, NULL));
            if (rc) (void)cu.unlock(pid, NULL);  /* as it was: running */
            return rc;
        }
        if (st == ST_CHECKPOINTED) {
            rc = do_restore(pid, pairs, npairs, api_version);
            return rc ? rc : check("cuCheckpointProcessUnlock", pid, cu.unlock(pid, NULL));
        }
        fprintf(stderr, "gpuckpt-cuda-checkpoint: pid %d is %s; --toggle moves only a running or a checkpointed "
                        "process\n", pid, state_name(st));
        return EXIT_DRIVER;
    }
    if (get_tid) {
        int tid = 0;
        rc = check("cuCheckpointProcessGetRestoreThreadId", pid, cu.get_restore_tid(pid, &tid));
        if (!rc) printf("%d\n", tid);
        return rc;
    }
    if (!strcmp(action, "lock")) return do_lock(pid, (unsigned int)timeout_ms);
    if (!strcmp(action, "checkpoint")) return check("cuCheckpointProcessCheckpoint", pid, cu.checkpoint(pid, NULL));
    if (!strcmp(action, "restore")) return do_restore(pid, pairs, npairs, api_version);
    return check("cuCheckpointProcessUnlock", pid, cu.unlock(pid, NULL));
}
