/*
 * A process tree for CRIU's parallel page reads (roles/criu/files/patches): NPROC processes, each with
 * NTHR threads and its own patterned memory (MIB MiB plus a few per process, mapped at addresses no
 * other process shares, so that CRIU restores each one's pages in its own restorer, not by
 * copy-on-write from the parent). On SIGUSR1 a process checks its memory and its thread count and
 * appends a line to OUT:  check <id> bad=<wrong words> threads=<alive>/<started> (seen within 10 ms)
 *
 *   page_tree NPROC NTHR MIB OUT
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

static uint64_t *words;
static size_t nwords;
static int nthreads;
static volatile sig_atomic_t asked;

static uint64_t expected(size_t i, int id) { return (i + (uint64_t)id) * 0x9E3779B97F4A7C15ull; }
static void on_usr1(int sig) { (void)sig; asked = 1; }
static void *idle(void *arg) { (void)arg; for (;;) pause(); return NULL; }

static void report(const char *out, const char *fmt, int id, size_t bad, int alive)
{
	FILE *f = fopen(out, "a");

	if (!f)
		exit(1);
	fprintf(f, fmt, id, bad, alive, nthreads);
	fclose(f);
}

static void run(int id, size_t mib, const char *out)
{
	sigset_t usr1;

	/* A mapping of a size of its own first: this process's memory lies where no other's does. */
	mmap(NULL, (size_t)(id + 1) << 20, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	nwords = (mib + 3 * (size_t)id) << 17;
	words = mmap(NULL, nwords * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (words == MAP_FAILED)
		exit(1);
	for (size_t i = 0; i < nwords; i++)
		words[i] = expected(i, id);
	sigemptyset(&usr1);
	sigaddset(&usr1, SIGUSR1);
	pthread_sigmask(SIG_BLOCK, &usr1, NULL); /* the threads never take it */
	for (int t = 0; t < nthreads; t++) {
		pthread_t th;

		if (pthread_create(&th, NULL, idle, NULL))
			exit(1);
	}
	signal(SIGUSR1, on_usr1);
	pthread_sigmask(SIG_UNBLOCK, &usr1, NULL);
	report(out, "ready %d %zu %d %d\n", id, 0, 0);
	for (;;) {
		size_t bad = 0;
		int alive = -1;
		char line[256];
		FILE *st;

		/* Not pause(): a task that CRIU resumes inside pause() runs its signal handler before it
		 * enters pause() again, so a SIGUSR1 sent the moment the restore returns (before the task
		 * was scheduled) would be taken by the handler and then waited for for ever. A sleep that
		 * looks at the flag again is woken by the signal, or sees it at the next tick. */
		usleep(10000);
		if (!asked)
			continue;
		asked = 0;
		for (size_t i = 0; i < nwords; i++)
			bad += words[i] != expected(i, id);
		st = fopen("/proc/self/status", "r");
		while (st && fgets(line, sizeof(line), st))
			if (sscanf(line, "Threads: %d", &alive) == 1)
				break;
		if (st)
			fclose(st);
		report(out, "check %d bad=%zu threads=%d/%d\n", id, bad, alive - 1);
	}
}

int main(int argc, char **argv)
{
	int nproc;

	if (argc != 5)
		return 2;
	nproc = atoi(argv[1]);
	nthreads = atoi(argv[2]);
	for (int i = 1; i < nproc; i++)
		if (fork() == 0)
			run(i, atoi(argv[3]), argv[4]);
	run(0, atoi(argv[3]), argv[4]);
	return 0;
}
