// What a sandbox made without bubblewrap would cost: a measurement, not part of the runner.
//
// benchmarks/template_floor.py compiles and runs this (as root) beside bubblewrap, in two modes.
//
//   template <runs> <network 0|1> <command> <etc view> <control dir> <empty dir>
//     Once, a template process makes its own mount namespace holding the read-only system view
//     (/usr, the /etc view, the prompt's control directory) and pivots into it; then it clone()s
//     <runs> sandboxes, one after the other: the design issue 26 sketches (parts prepared once).
//   launch <command> <etc view> <control dir> <empty dir>
//     One sandbox per run of this program, as bubblewrap is run today: clone() from a fresh process,
//     the view bound straight from the host's paths, this process waiting for it as bwrap does.
//
// Each sandbox gets what the local sandbox's bubblewrap line gives: its own PID, network, IPC, UTS,
// mount and cgroup namespaces; a tmpfs root with the system directories read-only and the hidden
// directories empty; a /dev of its own (the harmless nodes, a devpts instance, /dev/shm); a fresh
// /proc with /proc/sys read-only; size-capped tmpfs /tmp and working directory; the control
// directory read-only; the root made read-only and moved over the old one (MS_MOVE + chroot: no
// pivot_root, whose walk over every task on the machine is ~4 % of a thousand-prompt run); every
// capability dropped, no_new_privs, a new session, a parent-death signal; then `sh -c <command>`.
// The template prints "<template ms> <sandboxes ms>" of CPU per sandbox.
//
// Not here (what the runner would still need): the prompt's cgroup, the masks of the host's bound
// sockets, resolv.conf, the network link, descriptors closed and signals reset before the exec, a
// request protocol with the worker, a non-root variant (a user namespace of its own).
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static void die(const char *what) { perror(what); _exit(1); }
static void mnt(const char *src, const char *dst, const char *fs, unsigned long fl, const char *data) {
    if (mount(src, dst, fs, fl, data)) die(dst);
}
static void bind_ro(const char *src, const char *dst) {
    mnt(src, dst, NULL, MS_BIND | MS_REC, NULL);
    mnt(NULL, dst, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL);
}
static void mkdir_p(char *path) {  // a relative path in the new root, modified in place
    for (char *p = path + 1; *p; p++)
        if (*p == '/') { *p = 0; mkdir(path, 0755); *p = '/'; }
    mkdir(path, 0755);
}

struct paths {
    const char *usr, *etc, *ctl;  // where the sandbox's /usr, /etc and control directory come from
    const char *new_root;         // an empty directory to build the sandbox's root on
    const char *command;
    int view_is_read_only;        // the template's view: bound read-only once already
};
static const char *LINKS[][2] = {{"usr/bin", "bin"}, {"usr/sbin", "sbin"}, {"usr/lib", "lib"}, {"usr/lib64", "lib64"}};
static const char *HIDDEN[] = {"home", "root", "run", "var", "opt", "srv", "mnt", "media"};
static const char *DEVS[] = {"null", "zero", "full", "random", "urandom", "tty"};
static const char *WORKDIR = "workspace";
static char stack[1 << 16] __attribute__((aligned(16)));

static int sandbox(void *arg) {
    const struct paths *in = arg;
    char p[512];
    mnt(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    mnt("tmpfs", in->new_root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755");
    if (chdir(in->new_root)) die("chdir new root");
    const char *system[][2] = {{in->usr, "usr"}, {in->etc, "etc"}};
    for (int i = 0; i < 2; i++) {
        mkdir(system[i][1], 0755);
        if (in->view_is_read_only)
            mnt(system[i][0], system[i][1], NULL, MS_BIND | MS_REC, NULL);  // keeps the view's flags
        else
            bind_ro(system[i][0], system[i][1]);
    }
    for (int i = 0; i < 4; i++) symlink(LINKS[i][0], LINKS[i][1]);
    for (unsigned i = 0; i < sizeof HIDDEN / sizeof *HIDDEN; i++) mkdir(HIDDEN[i], 0755);
    mkdir("dev", 0755);
    mnt("tmpfs", "dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755");
    for (unsigned i = 0; i < sizeof DEVS / sizeof *DEVS; i++) {
        char src[64];
        snprintf(p, sizeof p, "dev/%s", DEVS[i]);
        snprintf(src, sizeof src, "/dev/%s", DEVS[i]);
        close(open(p, O_CREAT | O_WRONLY, 0666));
        mnt(src, p, NULL, MS_BIND, NULL);
    }
    mkdir("dev/shm", 01777);
    mkdir("dev/pts", 0755);
    mnt("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620");
    symlink("pts/ptmx", "dev/ptmx");
    symlink("/proc/self/fd", "dev/fd");
    symlink("/proc/self/fd/0", "dev/stdin");
    symlink("/proc/self/fd/1", "dev/stdout");
    symlink("/proc/self/fd/2", "dev/stderr");
    mkdir("proc", 0555);
    mkdir("tmp", 01777);
    mnt("tmpfs", "tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=4294967296,mode=1777");
    symlink("../tmp", "var/tmp");
    mkdir(".batch-runner", 0755);
    bind_ro(in->ctl, ".batch-runner");
    snprintf(p, sizeof p, "%s", WORKDIR);
    mkdir_p(p);
    mnt("tmpfs", p, "tmpfs", MS_NOSUID | MS_NODEV, "size=4294967296,mode=755");
    mnt(in->new_root, in->new_root, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID, NULL);
    mnt(".", "/", NULL, MS_MOVE, NULL);
    if (chroot(".") || chdir("/")) die("chroot");
    mnt("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    bind_ro("/proc/sys", "/proc/sys");
    if (access("/proc/sysrq-trigger", F_OK) == 0) bind_ro("/proc/sysrq-trigger", "/proc/sysrq-trigger");
    setsid();
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    for (int c = 0; c <= 63; c++) prctl(PR_CAPBSET_DROP, c, 0, 0, 0);
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2] = {{0}};
    if (syscall(SYS_capset, &h, d)) die("capset");
    if (chdir("/workspace")) die("chdir workspace");
    execl("/bin/sh", "sh", "-c", in->command, (char *)NULL);
    die("exec");
    return 1;
}

static int run_one(struct paths *in, int network) {
    int flags = CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNS | CLONE_NEWCGROUP | SIGCHLD;
    pid_t pid = clone(sandbox, stack + sizeof stack, flags | (network ? CLONE_NEWNET : 0), in);
    int st;
    if (pid < 0) die("clone");
    if (waitpid(pid, &st, 0) < 0) die("waitpid");
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static double ms(struct rusage *a, struct rusage *b) {
    return (b->ru_utime.tv_sec - a->ru_utime.tv_sec + b->ru_stime.tv_sec - a->ru_stime.tv_sec) * 1e3 +
           (b->ru_utime.tv_usec - a->ru_utime.tv_usec + b->ru_stime.tv_usec - a->ru_stime.tv_usec) / 1e3;
}

int main(int argc, char **argv) {
    if (argc == 6 && strcmp(argv[1], "launch") == 0) {
        struct paths in = {"/usr", argv[3], argv[4], argv[5], argv[2], 0};
        return run_one(&in, 1);
    }
    if (argc != 8 || strcmp(argv[1], "template") != 0) {
        fprintf(stderr, "usage: %s template runs network command etc_view ctl_dir empty_dir\n"
                        "       %s launch command etc_view ctl_dir empty_dir\n", argv[0], argv[0]);
        return 2;
    }
    int runs = atoi(argv[2]), network = atoi(argv[3]);
    const char *root = argv[7];
    char p[512];
    // Once: the template's own mount namespace, its root a tmpfs holding the read-only view.
    if (unshare(CLONE_NEWNS)) die("unshare");
    mnt(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    mnt("tmpfs", root, "tmpfs", 0, "mode=755");
    const char *dirs[] = {".view", ".view/usr", ".view/etc", ".ctl", ".new", "dev", "proc", ".old"};
    for (unsigned i = 0; i < sizeof dirs / sizeof *dirs; i++) {
        snprintf(p, sizeof p, "%s/%s", root, dirs[i]);
        mkdir(p, 0755);
    }
    snprintf(p, sizeof p, "%s/.view/usr", root); bind_ro("/usr", p);
    snprintf(p, sizeof p, "%s/.view/etc", root); bind_ro(argv[5], p);
    snprintf(p, sizeof p, "%s/.ctl", root); bind_ro(argv[6], p);
    snprintf(p, sizeof p, "%s/dev", root); mnt("/dev", p, NULL, MS_BIND | MS_REC, NULL);
    snprintf(p, sizeof p, "%s/proc", root); mnt("/proc", p, NULL, MS_BIND | MS_REC, NULL);
    snprintf(p, sizeof p, "%s/bin", root); symlink(".view/usr/bin", p);
    snprintf(p, sizeof p, "%s/lib64", root); symlink(".view/usr/lib64", p);
    if (chdir(root) || syscall(SYS_pivot_root, ".", ".old") || umount2("/.old", MNT_DETACH) || chdir("/"))
        die("pivot_root");
    mnt(NULL, "/", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL);
    struct paths in = {"/.view/usr", "/.view/etc", "/.ctl", "/.new", argv[4], 1};
    struct rusage self0, kids0, self1, kids1;
    getrusage(RUSAGE_SELF, &self0);
    getrusage(RUSAGE_CHILDREN, &kids0);
    for (int i = 0; i < runs; i++)
        if (run_one(&in, network)) { fprintf(stderr, "a sandbox failed\n"); return 1; }
    getrusage(RUSAGE_SELF, &self1);
    getrusage(RUSAGE_CHILDREN, &kids1);
    printf("%.3f %.3f\n", ms(&self0, &self1) / runs, ms(&kids0, &kids1) / runs);
    return 0;
}
