/*
 * TEST DOUBLE: a stand-in for libcuda.so.1, for CI machines that have no GPU.
 *
 * It implements the driver's checkpoint entry points and enforces their state machine
 *     running --Lock--> locked --Checkpoint--> checkpointed --Restore--> locked --Unlock--> running
 * returning CUDA_ERROR_ILLEGAL_STATE for a call out of order. Like driver 580.159.04 (measured on an
 * H200, tests/gpu/probe_driver.py): a live pid that is no CUDA process answers CUDA_ERROR_NOT_INITIALIZED,
 * a pid that does not exist CUDA_ERROR_OPERATING_SYSTEM.
 *
 * As with the real driver, a process's checkpoint state lives INSIDE that process: in the variable
 * fakecuda_state of its own copy of this library. The controller reads and writes it through
 * /proc/<pid>/mem (root). So the state travels with a CRIU image to another host or pid namespace,
 * and is restored with the process, exactly as the real GPU state does.
 *
 * A sandbox may forbid writing another process's memory (gVisor's /proc/<pid>/mem is read-only even
 * for root). There $FAKECUDA_PROC_STATE_DIR names a directory INSIDE the sandbox (a tmpfs that the
 * sandbox's checkpoint saves with its memory) where each process's state is the file <pid>, pids as
 * the sandbox sees them: the state still travels with the sandbox's image, as the real one does.
 *
 * Workloads "use the GPU" through two test-only calls:
 *   fakeCudaAttach()  makes the calling process a running CUDA process;
 *   fakeCudaSync()    blocks while the process is not running, like a real CUDA call under a lock.
 *
 * Errors are injected with lines "<call> <pid> <code>" in $FAKECUDA_STATE_DIR/inject, where <call>
 * is lock|checkpoint|restore|unlock|getstate (pid as the caller sees it; 0 matches any pid). A call is
 * made slow (a big GPU memory, a hung driver) with lines "<call> <pid> <milliseconds>" in
 * $FAKECUDA_STATE_DIR/delay: it sleeps that long after its state change, outside the big lock. A line of the
 * same form in $FAKECUDA_STATE_DIR/hold holds the call (after its state change) until the test removes that
 * line or file, for at most that long: a slow step that ends on the test's word, not a clock's. Every
 * call is appended to $FAKECUDA_STATE_DIR/calls.log as "<call> <pid> <time>", so tests can check
 * the order (all locks before any checkpoint). $FAKECUDA_API_VERSION, or a number in
 * $FAKECUDA_STATE_DIR/api_version, overrides what cuDriverGetVersion reports (13000: driver 580).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <dlfcn.h>
#include <stdint.h>
#include <unistd.h>

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_OPERATING_SYSTEM 304
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_TIMEOUT 909
#define CUDA_ERROR_UNKNOWN 999

enum { RUNNING = 0, LOCKED = 1, CHECKPOINTED = 2, FAILED = 3 };

static const char *state_dir(void) {
    const char *d = getenv("FAKECUDA_STATE_DIR");
    return (d && *d) ? d : "/tmp/fakecuda";
}

static void path_for(char *buf, size_t n, const char *name) { snprintf(buf, n, "%s/%s", state_dir(), name); }

/* One lock file serialises every state change, across processes. */
static int big_lock(void) {
    char p[4096];
    mkdir(state_dir(), 0700);
    path_for(p, sizeof p, ".lock");
    int fd = open(p, O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0) flock(fd, LOCK_EX);
    return fd;
}
static void big_unlock(int fd) { if (fd >= 0) { flock(fd, LOCK_UN); close(fd); } }

/* This process's own state: -1 until fakeCudaAttach(). Exported so its offset is stable. */
volatile int fakecuda_state = -1;

/* Address of fakecuda_state inside process pid: the base of this library's first mapping there plus
 * the variable's offset from our own base (the library's layout is the same in every process). */
static uintptr_t state_addr(int pid) {
    Dl_info info;
    if (!dladdr((void *)&fakecuda_state, &info) || !info.dli_fname) return 0;
    char self_path[4096];
    if (!realpath(info.dli_fname, self_path)) snprintf(self_path, sizeof self_path, "%s", info.dli_fname);
    uintptr_t off = (uintptr_t)&fakecuda_state - (uintptr_t)info.dli_fbase;
    char maps[64], line[8192];
    snprintf(maps, sizeof maps, "/proc/%d/maps", pid);
    FILE *f = fopen(maps, "r");
    if (!f) return 0;
    uintptr_t base = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi, foff;
        char perms[8], path[4096] = "";
        if (sscanf(line, "%lx-%lx %7s %lx %*s %*s %4095s", &lo, &hi, perms, &foff, path) >= 4 &&
            foff == 0 && strcmp(path, self_path) == 0) { base = lo; break; }
    }
    fclose(f);
    return base ? base + off : 0;
}

static const char *proc_state_dir(void) {
    const char *d = getenv("FAKECUDA_PROC_STATE_DIR");
    return (d && *d) ? d : NULL;
}

static int read_state_file(int pid) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%d", proc_state_dir(), pid);
    FILE *f = fopen(p, "r");
    if (!f) return -1;
    int s = -1;
    if (fscanf(f, "%d", &s) != 1) s = -1;
    fclose(f);
    return s;
}

static void write_state_file(int pid, int s) {
    char p[4096], tmp[4200];
    mkdir(proc_state_dir(), 0700);
    snprintf(p, sizeof p, "%s/%d", proc_state_dir(), pid);
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", p, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "%d\n", s);
    fclose(f);
    rename(tmp, p);
}

static int read_state(int pid) {
    if (proc_state_dir()) return read_state_file(pid);
    if (pid == getpid()) return fakecuda_state;
    uintptr_t addr = state_addr(pid);
    if (!addr) return -1;
    char p[64];
    snprintf(p, sizeof p, "/proc/%d/mem", pid);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int s = -1;
    if (pread(fd, &s, sizeof s, (off_t)addr) != (ssize_t)sizeof s) s = -1;
    close(fd);
    return s;
}

static void write_state(int pid, int s) {
    if (proc_state_dir()) { write_state_file(pid, s); return; }
    if (pid == getpid()) { fakecuda_state = s; return; }
    uintptr_t addr = state_addr(pid);
    if (!addr) return;
    char p[64];
    snprintf(p, sizeof p, "/proc/%d/mem", pid);
    int fd = open(p, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    if (pwrite(fd, &s, sizeof s, (off_t)addr) != (ssize_t)sizeof s) { /* reported by the next read */ }
    close(fd);
}

static void log_call(const char *call, int pid) {
    char p[4096];
    path_for(p, sizeof p, "calls.log");
    FILE *f = fopen(p, "a");
    if (!f) return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    fprintf(f, "%s %d %ld.%09ld\n", call, pid, (long)ts.tv_sec, ts.tv_nsec);
    fclose(f);
}

static int lookup(const char *file, const char *call, int pid) {
    char p[4096], c[64];
    int ipid, code;
    path_for(p, sizeof p, file);
    FILE *f = fopen(p, "r");
    if (!f) return 0;
    int rc = 0;
    while (fscanf(f, "%63s %d %d", c, &ipid, &code) == 3) {
        if (strcmp(c, call) == 0 && (ipid == pid || ipid == 0)) { rc = code; break; }
    }
    fclose(f);
    return rc;
}
static int injected(const char *call, int pid) { return lookup("inject", call, pid); }

static int pid_exists(int pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

/* The common shape of every checkpoint call: check, inject, move along the state machine. */
static int transition(const char *call, int pid, int from, int to) {
    int lk = big_lock();
    log_call(call, pid);
    int rc = injected(call, pid);
    if (!rc) {
        int s = read_state(pid);
        if (!pid_exists(pid)) rc = CUDA_ERROR_OPERATING_SYSTEM;
        else if (s < 0) rc = CUDA_ERROR_NOT_INITIALIZED;
        else if (s != from) rc = CUDA_ERROR_ILLEGAL_STATE;
        else write_state(pid, to);
    }
    big_unlock(lk);
    int ms = lookup("delay", call, pid);
    if (ms > 0) usleep((useconds_t)ms * 1000);
    /* A hold: the call does not return while its line is in the file (the test removes it), at most its ms. */
    int hold = lookup("hold", call, pid);
    for (int waited = 0; hold > 0 && waited < hold; waited += 20) {
        usleep(20000);
        if (lookup("hold", call, pid) <= 0) break;
    }
    return rc;
}

int cuInit(unsigned int flags) { (void)flags; return CUDA_SUCCESS; }
int cuDriverGetVersion(int *v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    const char *e = getenv("FAKECUDA_API_VERSION");
    *v = (e && *e) ? atoi(e) : 13000;
    char p[4096];
    path_for(p, sizeof p, "api_version");  /* per host, for tests whose hosts share an environment */
    FILE *f = fopen(p, "r");
    if (f) { if (fscanf(f, "%d", v) != 1) *v = 13000; fclose(f); }
    return CUDA_SUCCESS;
}
int cuDeviceGetCount(int *n) { if (!n) return CUDA_ERROR_INVALID_VALUE; *n = 0; return CUDA_SUCCESS; }
int cuDeviceGet(int *d, int i) { (void)d; (void)i; return 101; /* CUDA_ERROR_INVALID_DEVICE */ }

int cuGetErrorName(int code, const char **out) {
    switch (code) {
    case CUDA_SUCCESS: *out = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *out = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *out = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *out = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_ILLEGAL_STATE: *out = "CUDA_ERROR_ILLEGAL_STATE"; break;
    case CUDA_ERROR_NOT_FOUND: *out = "CUDA_ERROR_NOT_FOUND"; break;
    case CUDA_ERROR_OPERATING_SYSTEM: *out = "CUDA_ERROR_OPERATING_SYSTEM"; break;
    case CUDA_ERROR_TIMEOUT: *out = "CUDA_ERROR_TIMEOUT"; break;
    case CUDA_ERROR_UNKNOWN: *out = "CUDA_ERROR_UNKNOWN"; break;
    default: *out = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

int cuCheckpointProcessGetState(int pid, int *state) {
    if (!state) return CUDA_ERROR_INVALID_VALUE;
    int lk = big_lock();
    int rc = injected("getstate", pid);
    int s = read_state(pid);
    big_unlock(lk);
    if (rc) return rc;
    if (!pid_exists(pid)) return CUDA_ERROR_OPERATING_SYSTEM;
    if (s < 0) return CUDA_ERROR_NOT_INITIALIZED;
    *state = s;
    return CUDA_SUCCESS;
}

int cuCheckpointProcessLock(int pid, void *args) { (void)args; return transition("lock", pid, RUNNING, LOCKED); }
int cuCheckpointProcessCheckpoint(int pid, void *args) { (void)args; return transition("checkpoint", pid, LOCKED, CHECKPOINTED); }
/* CUcheckpointRestoreArgs (driver 580+): a pointer to the GPU pairs and their count lead it. The pairs a
 * restore was given are logged as "restore-pairs <pid> <old>=<new>,..." in calls.log, so tests see where
 * the process was put; a pair whose new GPU is not in $FAKECUDA_STATE_DIR/gpus (one UUID a line, when that
 * file exists: this host's GPUs) is refused with CUDA_ERROR_INVALID_VALUE, as the driver refuses a GPU it
 * does not have. */
typedef struct { unsigned char old_uuid[16]; unsigned char new_uuid[16]; } FakeGpuPair;
typedef struct { FakeGpuPair *pairs; unsigned int count; } FakeRestoreArgs;

static void format_uuid(const unsigned char *b, char *out) {
    sprintf(out, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2], b[3],
            b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static int host_has_gpu(const char *uuid) {
    char p[4096], line[128];
    path_for(p, sizeof p, "gpus");
    FILE *f = fopen(p, "r");
    if (!f) return 1;
    int found = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (strcasecmp(line, uuid) == 0) { found = 1; break; }
    }
    fclose(f);
    return found;
}

int cuCheckpointProcessRestore(int pid, void *args) {
    const FakeRestoreArgs *ra = (const FakeRestoreArgs *)args;
    if (ra && ra->count) {
        /* on the stack: the engine restores its processes from several threads at once */
        char entry[128], old_s[48], new_s[48], logp[4096], text[8192];
        text[0] = 0;
        int known = 1;
        for (unsigned int i = 0; i < ra->count && i < 64; i++) {
            format_uuid(ra->pairs[i].old_uuid, old_s);
            format_uuid(ra->pairs[i].new_uuid, new_s);
            snprintf(entry, sizeof entry, "%s%s=%s", i ? "," : "", old_s, new_s);
            strncat(text, entry, sizeof text - strlen(text) - 1);
            if (!host_has_gpu(new_s)) known = 0;
        }
        int lk = big_lock();
        path_for(logp, sizeof logp, "calls.log");
        FILE *f = fopen(logp, "a");
        if (f) { fprintf(f, "restore-pairs %d %s\n", pid, text); fclose(f); }
        big_unlock(lk);
        if (!known) return CUDA_ERROR_INVALID_VALUE;
    }
    return transition("restore", pid, CHECKPOINTED, LOCKED);
}
int cuCheckpointProcessUnlock(int pid, void *args) { (void)args; return transition("unlock", pid, LOCKED, RUNNING); }
int cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    if (!tid) return CUDA_ERROR_INVALID_VALUE;
    if (read_state(pid) < 0) return CUDA_ERROR_NOT_INITIALIZED;
    *tid = pid;
    return CUDA_SUCCESS;
}

/* ---- test-only entry points used by the CI workloads ---- */
int fakeCudaAttach(void) {
    fakecuda_state = RUNNING;
    if (proc_state_dir()) write_state_file(getpid(), RUNNING);
    log_call("attach", getpid());
    return CUDA_SUCCESS;
}

/* Blocks while this pid is locked or checkpointed, as a real CUDA call would under the driver's lock. */
int fakeCudaSync(void) {
    for (;;) {
        int s = proc_state_dir() ? read_state_file(getpid()) : fakecuda_state;
        if (s == RUNNING) return CUDA_SUCCESS;
        if (s == FAILED || s < 0) return CUDA_ERROR_UNKNOWN;
        usleep(2000);
    }
}
